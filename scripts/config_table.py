"""Print the README's configuration table from magrpo/config.py (field docstrings are the source).

    python scripts/config_table.py > /tmp/table.md
"""
from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "magrpo" / "config.py"
# Where each dataclass sits in the composed config.
PREFIX = {
    "TrainConfig": "", "ModelConfig": "model.", "AgentConfig": "agents[i].", "LoraConfig": "lora.",
    "GenerationConfig": "generation.", "TrainerConfig": "trainer.", "LoggingConfig": "logging.",
    "WandbConfig": "logging.wandb.", "ExternalConfig": "external.", "ExpertConfig": "external.expert.",
    "EvalConfig": "eval.", "CheckpointConfig": "checkpoint.", "RewardConfig": "reward.", "VLLMConfig": "vllm.",
}


def rows() -> list[tuple[str, str, str]]:
    out = []
    for cls in ast.parse(SOURCE.read_text()).body:
        if not isinstance(cls, ast.ClassDef) or cls.name not in PREFIX:
            continue
        body = cls.body
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.AnnAssign):
                continue
            doc = body[i + 1] if i + 1 < len(body) else None
            text = doc.value.value if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else ""
            default = ast.unparse(stmt.value) if stmt.value is not None else ""
            if "default_factory" in default:
                default = default.split("default_factory=")[1].rstrip(")").removeprefix("lambda: ")
            if text:  # nested config nodes (model, trainer, ...) have no docstring of their own
                out.append((PREFIX[cls.name] + stmt.target.id, default, text.replace("|", "\\|")))
    return out


if __name__ == "__main__":
    print("| key | default | meaning |\n|---|---|---|")
    for key, default, text in rows():
        print(f"| `{key}` | `{default}` | {text} |")
