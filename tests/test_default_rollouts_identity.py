"""The default config's rollouts are pinned byte for byte: options added beside the defaults (loss
and credit variants) must leave every sampled token, reward, return and advantage as it was.

Three steps of the tiny model on the toy env (the conftest shrink, CPU, one thread), so the rollouts
of steps 2 and 3 also carry the first two updates: a change in the loss or its gradient shows there.
The run's rollouts.jsonl must equal tests/data/default_rollouts.jsonl; the per-agent losses and
gradient norms of metrics.jsonl must equal tests/data/default_update_metrics.json (at 1e-6 relative).

The run happens in a child process pinned to kernels that compute alike on every x86 machine of
this kind (magrpo.pinned). Unpinned, the goldens held only on the kind of CPU that wrote them: the
AVX-512 goldens failed at step 2 on an AVX2-only machine. The cause: torch's vectorized kernels and
MKL's matrix products round differently per instruction set (and MKL picks its path by CPU vendor),
and the first AdamW step moves each weight by about lr x sign(gradient), so a last-bit difference in
a near-zero gradient changes that weight by up to 2 x lr and step 2 samples other tokens.

Regenerate the golden files only for a deliberate change of the default behaviour (or a torch /
transformers upgrade that changes numerics), and say so in the commit:

    MAGRPO_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_default_rollouts_identity.py
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
ROLLOUTS = DATA / "default_rollouts.jsonl"
UPDATES = DATA / "default_update_metrics.json"
REGEN = os.environ.get("MAGRPO_REGEN_GOLDEN") == "1"

# Only what cannot change a rollout: the device, no evaluation, no console output, no checkpoint
# beyond the last.
PINNED = ["trainer.steps=3", "model.device=cpu", "eval.at_end=false"]


def update_metrics(run: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    keys = [k for k in rows[0] if k.startswith("train/agent_") and k.rsplit("/", 1)[1] in ("loss", "grad_norm")]
    return [{k: row[k] for k in sorted(keys)} for row in rows]


def first_difference(got: list[str], want: list[str]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            at = next(c for c in range(min(len(g), len(w)) + 1) if g[c : c + 1] != w[c : c + 1])
            near = slice(max(0, at - 80), at + 80)
            return f"line {i + 1} (step {json.loads(w)['step']}), char {at}: got ...{g[near]!r}, want ...{w[near]!r}"
    return f"{len(got)} lines, want {len(want)}"


@pytest.mark.slow
def test_default_config_rollouts_are_unchanged(pinned_train):
    run = pinned_train(*PINNED)  # on the AVX2 machine: the same bytes whatever ATEN_CPU_CAPABILITY the parent has
    got = (run / "rollouts.jsonl").read_text()
    updates = update_metrics(run)
    if REGEN:
        DATA.mkdir(exist_ok=True)
        ROLLOUTS.write_text(got)
        UPDATES.write_text(json.dumps(updates, indent=1) + "\n")
        pytest.skip("golden files regenerated; commit them")
    want = ROLLOUTS.read_text()
    assert got == want, "default rollouts changed: " + first_difference(got.splitlines(), want.splitlines())
    expected = json.loads(UPDATES.read_text())
    assert [sorted(u) for u in updates] == [sorted(e) for e in expected]
    for step, (u, e) in enumerate(zip(updates, expected), start=1):
        for key in e:
            assert u[key] == pytest.approx(e[key], rel=1e-6, abs=1e-8), f"step {step} {key}"
