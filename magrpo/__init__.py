"""magrpo: multi-agent, multi-turn GRPO on tree rollouts (MAGRPO-MT)."""
__version__ = "0.1.0"


def _import_checkout_subpackages() -> None:
    """Installed, the repo's top-level folders envs/ and external/ sit inside this package
    (pyproject.toml maps them to magrpo.envs and magrpo.external). In a checkout they sit beside
    it: let `import magrpo.envs` find them there too, so both import the same way."""
    import sys
    from importlib.machinery import PathFinder
    from pathlib import Path

    here = Path(__file__).resolve().parent
    names = {f"{__name__}.{name}" for name in ("envs", "external")
             if not (here / name).exists() and (here.parent / name / "__init__.py").is_file()}

    # Answers only for those names (never found inside this folder), and before any other finder:
    # an editable install of another checkout maps them to that checkout's folders.
    class CheckoutFinder:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            return PathFinder.find_spec(fullname, [str(here.parent)]) if fullname in names else None

    if names and not any(getattr(f, "__name__", "") == "CheckoutFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder)


_import_checkout_subpackages()


def __getattr__(name: str):
    """`magrpo.train`, imported on first use: `import magrpo` stays cheap (no torch, no Hydra)."""
    if name == "train":
        from .api import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
