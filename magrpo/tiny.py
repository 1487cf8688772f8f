"""A tiny, randomly initialised Qwen2 causal LM with a locally trained tokenizer.

Built deterministically in a couple of seconds, with no download, and saved as an ordinary
Hugging Face folder, so the trainer loads it through `AutoTokenizer.from_pretrained(path)` /
`AutoModelForCausalLM.from_pretrained(path)` exactly as it would load a hub model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .console import quiet_progress_bars
from .errors import ConfigError, FetchError, describe
from .paths import CACHE_VAR, cache_root, damage, owned_folder, remove_tree, seal, sweep

# Bump when the build recipe changes, so old cached folders are not reused.
FORMAT_VERSION = 1
# ~4 MB of stdlib source trains a 4096-token BPE in ~1 s (2 cores); ~3.7 chars/token on unseen stdlib code.
CORPUS_BYTES = 4_000_000
EOS_TOKEN = "<|endoftext|>"
# Distinct from eos: pad == eos makes a completion's eos indistinguishable from padding.
PAD_TOKEN = "<|pad|>"
# Strings whose ids must survive save + `AutoTokenizer` reload (code, unicode, whitespace runs).
SAMPLE_TEXTS = (
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))  # -> 3\n",
    "héllo wörld — naïve café, 你好, Ωμέγα 🎉",
    "a\t\tb    c\r\n\n   \n\t end  ",
    f"x{EOS_TOKEN}y{PAD_TOKEN}",
)


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 2
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    # Wider than transformers' 0.02: with tied embeddings the largest logit a LoRA can reach is about
    # init_std * hidden_size, and at 0.02 (2.6) no token, EOS included, can ever become likely.
    init_std: float = 0.1
    seed: int = 0


def _corpus_files() -> tuple[Path, list[Path]]:
    """The stdlib's *.py files in a fixed order (depth, then path), cut at CORPUS_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned, not filtered: installed packages vary between machines and can be huge.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel += [Path(dirpath, f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")]
    # Top-level modules first (ordinary code); deeper packages such as encodings/ hold big data tables.
    rel.sort(key=lambda name: (name.count("/"), name))
    files, total = [], 0
    for name in rel:
        if total >= CORPUS_BYTES:
            break
        files.append(root / name)
        total += (root / name).stat().st_size
    return root, files


def _key(spec: TinySpec, root: Path, files: list[Path]) -> str:
    # The corpus digest makes a different Python version (different stdlib) a different model.
    corpus = [(f.relative_to(root).as_posix(), f.stat().st_size) for f in files]
    payload = json.dumps({"format": FORMAT_VERSION, "spec": dataclasses.asdict(spec), "corpus": corpus},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_model_path(spec: TinySpec = TinySpec(), cache_dir: str | Path | None = None) -> Path:
    """Return the folder of the tiny model for `spec`, building it on first use (cached)."""
    root, files = _corpus_files()
    final = cache_root(cache_dir) / "tiny" / _key(spec, root, files)
    return build_once(final, lambda tmp: _build(spec, tmp, files), "tiny model")


def build_once(final: Path, build: Callable[[Path], None], what: str) -> Path:
    """`final`, built by `build(folder)` unless it holds a complete entry: built next to it in a folder
    this process owns (paths.owned_folder: swept by the next build when a killed one left it), sealed
    with its files' sizes and sha256 (paths.COMPLETE) and renamed into place, so racing processes share
    one. A broken entry (truncated weights, a file missing, bytes changed) is said and built again; a cache
    that cannot be written is one line naming MAGRPO_CACHE and the folder."""
    why = damage(final) if final.exists() else None
    if final.exists() and why is None:
        return final
    with cache_writes(final, what):
        final.parent.mkdir(parents=True, exist_ok=True)
        for left in sweep(final.parent, ".", ".tmp"):
            print(f"magrpo: removed {left}, left by a build that did not finish", file=sys.stderr)
        # Build next to the target (same filesystem) so the final rename is atomic.
        tmp, lock = owned_folder(final.parent, f".{final.name}.", ".tmp")
    try:
        if why is not None:
            print(f"magrpo: the cached {what} {final} is broken ({why}); building it again", file=sys.stderr)
        print(f"building {what} {final.name} (once, cached at {final})", file=sys.stderr)
        with _caller_random_state_kept():
            try:
                build(tmp)
            except Exception as e:
                if why is None or isinstance(e, ConfigError):
                    raise
                raise FetchError(f"{CACHE_VAR}: the cached {what} {final} is broken ({why}) and could not be "
                                 f"built again: {describe(e)}; delete {final}, or point {CACHE_VAR} at a cache "
                                 f"holding a complete copy") from e
        seal(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        with cache_writes(final, what):
            if why is not None:
                _discard(final)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process won the race: use its folder, drop ours (in `finally`).
                if damage(final) is not None:
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
        os.close(lock)
    return final


def _discard(final: Path) -> None:
    """Move a broken entry out of the way (renamed first: no half-deleted folder keeps its name)."""
    doomed = final.with_name(f".{final.name}.{os.getpid()}-broken__.tmp")
    if final.exists():
        os.rename(final, doomed)
    remove_tree(doomed)


@contextmanager
def cache_writes(final: Path, what: str) -> Iterator[None]:
    """An OSError while writing the cache (read-only, a file where a folder belongs, a full disk) as
    one line naming MAGRPO_CACHE and the folder."""
    try:
        yield
    except OSError as e:
        raise ConfigError(CACHE_VAR, f"cannot write the {what} to {final} ({type(e).__name__}: "
                                     f"{e.strerror or e}); make {final.parent} writable, delete {final}, or "
                                     f"point {CACHE_VAR} at a writable folder") from None


@contextmanager
def _caller_random_state_kept() -> Iterator[None]:
    """Builds seed their own generators (torch.manual_seed): without this, a run that found its model
    missing from the cache trained from another random state (other LoRA initial weights) than the
    same run with a warm cache."""
    import random

    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _train_tokenizer(spec: TinySpec, files: list[Path]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Qwen2's exact pipeline: transformers 5 loads this folder (config.json says qwen2) as
    # `Qwen2Tokenizer`, which rebuilds this pre-tokenizer from scratch; any other pipeline
    # (e.g. plain ByteLevel with its own regex) would give different ids after reload.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens
        show_progress=False,
    )
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]  # BPE training is deterministic
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _build(spec: TinySpec, out: Path, files: list[Path]) -> None:
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = _train_tokenizer(spec, files)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        padding_side="left",  # a constructor kwarg, so it lands in tokenizer_config.json
        model_max_length=spec.max_position_embeddings,
    )
    eos_id, pad_id = hf_tok.convert_tokens_to_ids(EOS_TOKEN), hf_tok.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(),  # the trained size, which can fall short of spec.vocab_size
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=spec.init_std,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    with quiet_progress_bars():
        hf_tok.save_pretrained(out)
        model.save_pretrained(out, safe_serialization=True)
    _verify(out, tok)


def _verify(out: Path, tok) -> None:
    """Reload through the same path the trainer uses and check that ids round-trip."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out)
    if loaded.pad_token_id is None or loaded.pad_token_id == loaded.eos_token_id:
        raise RuntimeError(f"tiny tokenizer: pad id {loaded.pad_token_id} must differ from eos id "
                           f"{loaded.eos_token_id}")
    for text in SAMPLE_TEXTS:
        want = tok.encode(text).ids
        got = loaded(text, add_special_tokens=False)["input_ids"]
        if got != want:
            raise RuntimeError(f"tiny tokenizer ({type(loaded).__name__}) re-tokenizes {text!r} "
                               f"differently after reload: {got} != {want}")
        back = loaded.decode(got)
        if back != text:
            raise RuntimeError(f"tiny tokenizer does not decode back: {back!r} != {text!r}")
