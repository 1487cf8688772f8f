"""rollouts.jsonl says what each model read and wrote: for a 2-agent run with tools, every record's
prompt_ids are the ids the trainer encodes for that node's prompts (chat template, tools preamble), its
completion_ids decode to its text, the loss mask's 0s are exactly the tool messages of its recorded
calls, and prompt_ids + completion_ids is so the whole sequence the update scored. Pinned to portable
kernels (`pinned_train`), yet an Intel AMX Xeon sampled other calls than the AMD machines (the cause is
not found), so the run is sized to make a call all but certain on any of them (OVERRIDES)."""
from __future__ import annotations

import json

import pytest

from magrpo.envs.tool_arith_warm import warm_model_path

# The warm model starts a call with probability 0.2 (WarmSpec.call_share; measured 0.198-0.201 on its
# first token) and its turn-2 replies to the revise prompt are mostly garbage, so the calls come from the
# turn-1 samples: 2 agents x batch_size x num_generations decisions. At 2 x 2 x 4 = 16 none calls with
# probability 0.8**16 = 2.8%, and an Intel AMX Xeon drew exactly that (the AMD machines had not); at
# 2 x 4 x 8 = 64 the chance is 0.8**64 < 1e-6, whatever stream a CPU kind samples.
OVERRIDES = ["env=tool_arith", "env.num_agents=2", "external=plain", "tools=[calculator]", "tools.max_calls=1",
             "generation.max_new_tokens=72", "trainer.num_turns=2", "trainer.steps=1", "trainer.batch_size=4",
             "trainer.num_generations=8", "eval.at_end=false"]


@pytest.mark.slow
def test_a_tool_runs_records_rebuild_every_agents_exact_input_ids(pinned_train):
    from magrpo.models import load_agents
    from magrpo.toolbox import Toolbox
    from magrpo.tools import response_text
    from tests.conftest import SMALL, compose

    overrides = [*OVERRIDES, f"model.name={warm_model_path()}"]
    run = pinned_train(*overrides)
    cfg = compose([*SMALL, *overrides])
    with Toolbox.open(cfg.tools) as box:
        agents = load_agents(cfg, 2, box.schemas)
    records = [json.loads(line) for line in open(run / "rollouts.jsonl")]
    calls = 0
    for node in (node for record in records for node in record["nodes"]):
        for a, agent in enumerate(agents):
            tok = agent.tokenizer
            assert node["prompt_ids"][a] == agent.encode_prompts([node["prompts"][a]])[0]
            for k, ids in enumerate(node["completion_ids"][a]):
                assert tok.decode(ids, skip_special_tokens=True) == node["completions"][a][k]
                mask = node.get("loss_mask", [[[1] * len(i) for i in row] for row in node["completion_ids"]])[a][k]
                recorded = node.get("tool_calls", [[[] for _ in row] for row in node["completion_ids"]])[a][k]
                inserted = tok.decode([t for t, m in zip(ids, mask) if not m])
                assert len(mask) == len(ids)
                assert inserted == "".join(response_text(call["output"]) for call in recorded if call["inserted"])
                calls += len(recorded)
    assert calls > 0, "no completion called the calculator: nothing of the tool records was checked"
