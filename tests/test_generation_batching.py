"""The HF backend on the tiny model: one generate call per turn for all trees, nodes, agents and
samples; completions cut at EOS from token ids; generation and training agree on log-probs."""
from __future__ import annotations

import copy

import pytest
import torch

from magrpo.backends.hf import HFBackend
from magrpo.config import ExternalConfig
from magrpo.envs.length_ratio import LengthRatioEnv
from magrpo.external.plain import plain
from magrpo.feedback import Feedback
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.models import load_agents
from magrpo.rollout import expand_trees
from magrpo.sampling import Scratch, stream_key
from magrpo.tiny import TinySpec, tiny_model_path
from magrpo.update import TrainSample, forward_logprobs, pack
from tests.fakes import tree_settings
from tests.near_ties import same_up_to_a_near_tie, shared_prefix

SAMPLING = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    from tests.conftest import SMALL, compose

    cfg = compose([*SMALL, "lora.r=4"])
    torch.manual_seed(0)  # peft draws the adapters' A at load: the same agents in every process
    agents = load_agents(cfg, 2)
    # Make the adapters differ from the base so mixed-adapter routing matters.
    torch.manual_seed(0)
    for name, p in agents[0].model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    return agents


def bfloat16_copy(agents, float_adapters: bool = False):
    """The agents' model in bfloat16, as a copy: a round trip of the shared one through bfloat16 would round its
    weights for every later test of this module. `float_adapters`: the LoRA weights float32 again, as models.py
    keeps them in a bfloat16 model (the batched hook then casts its input and adds its float32 sum)."""
    model = copy.deepcopy(agents[0].model).eval().to(torch.bfloat16)
    if float_adapters:
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.float()
    return model


@pytest.mark.parametrize("batch,k", [(1, 2), (3, 4)])
@pytest.mark.parametrize("mode", ["align", "cross"])
def test_generate_calls_per_step_do_not_grow_with_batch_or_k(agents, batch, k, mode):
    env = LengthRatioEnv(LengthRatioEnv.Config(num_agents=2))
    backend = HFBackend(agents)
    problems = env.problems("train")[:batch]
    feedback = Feedback(ExternalConfig(), env, plain)
    rollout = expand_trees(problems, env, backend, feedback, tree_settings(num_generations=k, num_turns=2,
                                                                           joint_mode=mode), SAMPLING)
    assert backend.generate_calls == 2  # one per turn, whatever B, K, N and the number of nodes
    joint = k if mode == "align" else k * k
    assert len(rollout.nodes) == batch * (1 + joint)


def test_agents_with_their_own_base_model_get_one_call_each_per_turn(make_cfg, tmp_path):
    paths = [tiny_model_path(TinySpec(seed=s), cache_dir=tmp_path) for s in (0, 1)]
    cfg = make_cfg(f"agents=[{{model: {paths[0]}}},{{model: {paths[1]}}}]")
    agents = load_agents(cfg, 2)
    assert agents[0].model is not agents[1].model
    env = LengthRatioEnv(LengthRatioEnv.Config(num_agents=2))
    backend = HFBackend(agents)
    feedback = Feedback(ExternalConfig(), env, plain)
    expand_trees(env.problems("train")[:2], env, backend, feedback, tree_settings(num_generations=2, num_turns=2,
                                                                                  joint_mode="align"), SAMPLING)
    assert backend.generate_calls == 2 * 2  # two base models, two turns


def test_completions_end_at_eos_and_carry_no_padding(agents):
    backend = HFBackend(agents)
    tok = agents[0].tokenizer
    eos = tok.eos_token_id
    params = SamplingParams(max_new_tokens=12, temperature=3.0)  # hot: some rows stop early
    torch.manual_seed(1)
    out = backend.generate([GenerationRequest("def f(x):", a, 16) for a in (0, 1)], params)
    completions = [c for per_request in out for c in per_request]
    assert len(completions) == 32
    for c in completions:
        assert tok.pad_token_id not in c.token_ids
        if c.finished:
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 12 and eos not in c.token_ids
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_match_the_trainers_recomputed_logprobs(agents, temperature):
    """Left-padded generation and right-padded training must see the same positions and adapters,
    and score under the temperature the tokens were drawn at."""
    backend = HFBackend(agents)
    prompts = ["x", "def add(a, b):\n    return a + b\n", "import os"]  # different lengths -> left padding
    params = SamplingParams(max_new_tokens=8, temperature=temperature, logprobs=True)  # no top-k/p
    requests = [GenerationRequest(p, a, 2) for p in prompts for a in (0, 1)]
    out = backend.generate(requests, params)
    model = agents[0].model
    model.eval()
    for req, completions in zip(requests, out):
        model.set_adapter(agents[req.agent].adapter)
        samples = [TrainSample(c.prompt_ids, c.token_ids, 0.0) for c in completions]
        batch = pack(samples, agents[0].tokenizer.pad_token_id).to(model.device)  # as the updater does
        with torch.no_grad():
            logp, _ = forward_logprobs(model, batch, temperature)
        for row, c in enumerate(completions):
            torch.testing.assert_close(logp[row][batch.target_mask[row]].cpu(), torch.tensor(c.logprobs),
                                       atol=2e-4, rtol=1e-4)


MINE = GenerationRequest("def f(x):", 1, 3, seed=stream_key(0, 5))
OTHERS = [GenerationRequest(p, a, 4, seed=stream_key(1, i)) for i, (p, a) in
          enumerate([("import os", 0), ("x = [", 1), ("class A:\n    def", 0)])]
HOT = SamplingParams(max_new_tokens=8, temperature=1.5, logprobs=True)  # no top-k/top-p: see tests/near_ties.py


def mine_in(backend, requests):
    return backend.generate(requests, HOT)[requests.index(MINE)]


def test_a_seeded_request_samples_the_same_alone_in_a_batch_or_in_chunks(agents):
    """Per-row random streams: what a request samples does not depend on the rest of the call (the
    basis of data-parallel runs matching one process), and changes with its seed. Rows decoded one
    at a time, so only the streams can differ (tests/near_ties.py: full batches may round the logits
    otherwise)."""
    def ids(requests):
        return [c.token_ids for c in mine_in(HFBackend(agents, max_batch_rows=1), requests)]

    alone = ids([MINE])
    assert ids([*OTHERS, MINE]) == alone
    assert ids([OTHERS[0], MINE, OTHERS[1]]) == alone
    reseeded = GenerationRequest(MINE.prompt, MINE.agent, MINE.n, seed=stream_key(0, 6))
    assert [c.token_ids for c in HFBackend(agents).generate([reseeded], HOT)[0]] != alone
    assert len({tuple(t) for t in alone}) > 1  # the n samples of one request differ from each other


def test_a_request_in_a_full_batch_samples_the_same_up_to_near_ties(agents):
    """Decoded with other requests (other row counts and left padding), a request's samples keep their
    streams: equal tokens, log-probs within rounding, except where a uniform falls on a CDF boundary."""
    alone = mine_in(HFBackend(agents, max_batch_rows=1), [MINE])
    for backend in (HFBackend(agents), HFBackend(agents, max_batch_rows=2)):
        for got, want in zip(mine_in(backend, [*OTHERS, MINE]), alone):
            assert same_up_to_a_near_tie(got.token_ids, want.token_ids), (got.token_ids, want.token_ids)
            n = shared_prefix(got.token_ids, want.token_ids)
            torch.testing.assert_close(torch.tensor(got.logprobs[:n]), torch.tensor(want.logprobs[:n]),
                                       rtol=0, atol=1e-4)


def test_training_scores_tokens_under_the_sampling_temperature(make_cfg):
    """At temperature 0.7 the trainer's log-probs are the sampler's (no off-policy gap to correct):
    the logged mismatch is float noise, not the 0.1-0.5 nats it was when training ignored it."""
    import json

    from magrpo.trainer import train

    run = train(make_cfg("generation.temperature=0.7", "trainer.steps=1", "eval.at_end=false"))
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for agent in (0, 1):
        assert metrics[f"train/agent_{agent}/logp_mismatch"] < 1e-4, metrics[f"train/agent_{agent}/logp_mismatch"]


@pytest.mark.parametrize("grouped", [True, False])
def test_row_adapters_compute_what_peft_mixed_batching_does(agents, grouped):
    """Rows grouped by agent (what the backend decodes): bit for bit; interleaved: to rounding (peft
    gathers an agent's rows into one matrix, RowAdapters multiplies each run of rows on its own)."""
    from magrpo.backends.hf import RowAdapters

    model = agents[0].model.eval()
    rows = ["agent_0"] * 3 + ["agent_1"] * 2 if grouped else ["agent_1", "agent_0", "agent_1", "agent_0"]
    ids = torch.randint(3, 200, (len(rows), 7), generator=torch.Generator().manual_seed(1)).to(model.device)
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=rows).logits
        with RowAdapters(model).active() as routing:
            got = model(input_ids=ids, **routing.rows(rows)).logits
        after = model(input_ids=ids, adapter_names=rows).logits
        one_adapter = model(input_ids=ids, adapter_names=["agent_0"] * len(rows)).logits
    assert routing.layers, "the tiny model's LoRA layers take the fast path"
    assert not torch.allclose(one_adapter, want)  # the routing matters
    if grouped:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)
    assert torch.equal(after, want)  # hooks removed, adapters enabled again


def routed_and_per_slice(model, routing, ids: torch.Tensor, rows: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of `ids`, row i through adapter rows[i]: by `routing`, and by a RowAdapters that takes one
    slice at a time."""
    from magrpo.backends.hf import RowAdapters

    per_slice = RowAdapters(model)
    per_slice._batched = lambda weights, x: False
    with torch.no_grad():
        with routing.active():
            got = model(input_ids=ids, **routing.rows(rows)).logits
        with per_slice.active():
            want = model(input_ids=ids, **per_slice.rows(rows)).logits
    return got, want


def test_equal_slices_in_reduced_precision_go_through_one_batched_product_with_the_same_bits(agents):
    """bfloat16 rows in equal runs per agent (a decode's usual shape): both adapters in two batched products
    per layer, the same logits bit for bit as one slice at a time (and as peft's mixed batching); unequal
    runs and float32 take the per-slice path."""
    from magrpo.backends.hf import RowAdapters

    model = bfloat16_copy(agents)
    ids = torch.randint(3, 200, (6, 7), generator=torch.Generator().manual_seed(2)).to(model.device)
    rows = ["agent_0"] * 3 + ["agent_1"] * 3
    batched, calls = RowAdapters(model), []
    real = batched._add_lora_batched
    batched._add_lora_batched = lambda *a: calls.append(1) or real(*a)
    got, want = routed_and_per_slice(model, batched, ids, rows)
    with torch.no_grad():
        peft = model(input_ids=ids, adapter_names=rows).logits
        assert calls and torch.equal(got, want) and torch.equal(got, peft)
        calls.clear()
        with batched.active():  # runs of 4 and 2 rows: one slice at a time
            model(input_ids=ids, **batched.rows(["agent_0"] * 4 + ["agent_1"] * 2))
        assert not calls
        model.to(torch.float32)
        with batched.active():  # float32: one slice at a time (its goldens are bit-exact)
            model(input_ids=ids, **batched.rows(rows))
    assert not calls


@pytest.mark.parametrize("scaling,folded", [(8.0, True), (0.5, True), (1.5, False)])
def test_a_power_of_two_scaling_is_folded_into_the_batched_b_with_the_same_bits(agents, scaling, folded):
    """The batched hook multiplies B by a power-of-two scaling once (exact in every product and sum) instead of
    scaling each layer's output; any other scaling keeps the multiply. Either way the logits are one slice at a
    time's bits."""
    from magrpo.backends.hf import RowAdapters

    model = bfloat16_copy(agents)
    layers = [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "lora_A")]
    for layer in layers:
        for name in layer.scaling:
            layer.scaling[name] = scaling
    ids = torch.randint(3, 200, (6, 7), generator=torch.Generator().manual_seed(4)).to(model.device)
    got, want = routed_and_per_slice(model, RowAdapters(model), ids, ["agent_0"] * 3 + ["agent_1"] * 3)
    stacked = RowAdapters._stacked(RowAdapters._weights(layers[0]), ("agent_0", "agent_1"))
    assert (stacked[2] is None) == folded
    assert torch.equal(got, want)


def test_projections_of_one_input_share_the_batched_hooks_cast_with_the_same_bits(agents):
    """q, k and v take one input, as do the MLP's gate and up: the batched hook casts it to the adapters' float32
    once for them (4 casts per decoder layer, not 7), and the logits stay one slice at a time's bits."""
    from magrpo.backends.hf import RowAdapters

    model = bfloat16_copy(agents, float_adapters=True)
    ids = torch.randint(3, 200, (6, 7), generator=torch.Generator().manual_seed(5)).to(model.device)
    names = []

    class Counted(Scratch):  # which buffers the hook asks for
        def __call__(self, name, *args):
            names.append(name)
            return super().__call__(name, *args)

    shared = RowAdapters(model)
    shared.scratch = Counted()
    got, want = routed_and_per_slice(model, shared, ids, ["agent_0"] * 3 + ["agent_1"] * 3)
    layers = model.get_base_model().config.num_hidden_layers
    assert len(shared.layers) == 7 * layers and names.count("input") == 4 * layers
    assert torch.equal(got, want) and shared.last_cast is None  # let go with the call


def test_the_batched_hooks_reused_buffers_give_the_fresh_tensors_bits_and_go_with_the_call(agents):
    """Without gradients the batched LoRA hook writes its intermediates into buffers reused from layer to layer
    (fresh large tensors cost page faults): a prefill's logits and KV cache are the same bits as the hook
    computing in fresh tensors (its path with gradients), and the buffers are freed when the call ends."""
    from magrpo.backends.hf import RowAdapters

    model = bfloat16_copy(agents, float_adapters=True)
    ids = torch.randint(3, 200, (8, 40), generator=torch.Generator().manual_seed(3)).to(model.device)
    rows = ["agent_0"] * 4 + ["agent_1"] * 4
    reused, fresh = RowAdapters(model), RowAdapters(model)
    with torch.no_grad(), reused.active():
        got = model(input_ids=ids, use_cache=True, **reused.rows(rows))
        assert reused.scratch  # the buffers were used
    assert not reused.scratch
    with torch.enable_grad(), fresh.active():
        want = model(input_ids=ids, use_cache=True, **fresh.rows(rows))
    assert not fresh.scratch
    assert torch.equal(got.logits, want.logits.detach())
    for got_layer, want_layer in zip(got.past_key_values.layers, want.past_key_values.layers):
        assert torch.equal(got_layer.keys, want_layer.keys.detach())
        assert torch.equal(got_layer.values, want_layer.values.detach())


def test_row_routing_leaves_each_layers_switch_hooks_and_grads_as_it_found_them(agents):
    """RowAdapters turns the LoRA layers' own switches off for a decode and back, also when the forward
    raises. peft's disable_adapter() (which it used before) re-sets requires_grad on the way out: a model
    with frozen adapters came back with the active one trainable."""
    from magrpo.backends.hf import RowAdapters

    model = agents[0].model.eval()
    routing = RowAdapters(model)
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    before = [p.requires_grad for p in lora]
    try:
        for p in lora:
            p.requires_grad_(False)
        ids = torch.tensor([[5, 6, 7]], device=model.device)
        with torch.no_grad():
            want = model(input_ids=ids).logits
            with pytest.raises(RuntimeError, match="inside"):
                with routing.active():
                    assert all(layer.disable_adapters for layer in routing.layers)
                    raise RuntimeError("inside")
            assert not any(layer.disable_adapters for layer in routing.layers)
            assert not any(layer._forward_hooks for layer in routing.layers)  # the hooks are gone
            assert not any(p.requires_grad for p in lora)
            assert torch.equal(model(input_ids=ids).logits, want)
    finally:
        for p, grad in zip(lora, before):
            p.requires_grad_(grad)


@pytest.mark.parametrize("logprobs", [False, True])
def test_dropping_finished_rows_keeps_every_rows_stream(agents, logprobs):
    """Every row keeps its stream: tokens equal up to near ties, log-probs to float rounding (a smaller
    batch's matrix products may round otherwise: ~2e-6 here; tests/near_ties.py)."""
    from magrpo.backends.hf import decode

    model = agents[0].model
    prompts = [agents[0].encode_prompts(["def f(x):"])[0], agents[1].encode_prompts(["import os\n"])[0]]
    expand = torch.tensor([0] * 6 + [1] * 6)
    params = SamplingParams(max_new_tokens=24, temperature=1.3, logprobs=logprobs)  # no top-p: near ties
    eos = list(range(3, 4096, 17))  # many stop tokens: rows end at many different lengths
    rows_run = []  # batch rows of every forward
    hook = model.register_forward_pre_hook(lambda m, args, kw: rows_run.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    run, work = {}, {}
    try:
        for drop in (False, True):
            rows_run.clear()
            run[drop] = decode(model, prompts, ["agent_0", "agent_1"], expand, params,
                               torch.tensor([stream_key(9, r) for r in range(12)]), agents[0].tokenizer.pad_token_id,
                               eos, drop_finished=drop)
            work[drop] = sum(rows_run)
    finally:
        hook.remove()
    assert work[True] < 0.8 * work[False]  # finished rows really left the batch
    lengths = [next((t + 1 for t, i in enumerate(row.tolist()) if i in eos), len(row)) for row in run[False][0]]
    assert len(set(lengths)) > 3 and min(lengths) < 12  # rows really finish early, at different steps
    for row, n in enumerate(lengths):
        dropped, kept = run[True][0][row].tolist(), run[False][0][row, :n].tolist()
        dropped = dropped[: next((t + 1 for t, i in enumerate(dropped) if i in eos), len(dropped))]
        assert same_up_to_a_near_tie(dropped, kept), (row, dropped, kept)
        if logprobs:
            m = shared_prefix(dropped, kept)
            torch.testing.assert_close(run[True][1][row, :m], run[False][1][row, :m], rtol=0, atol=1e-5)


def test_each_request_stops_at_its_own_budget_and_its_text_is_its_tokens(agents):
    """A resumed tool turn has its own room left (GenerationRequest.max_new_tokens): the backend stops
    the row there, not finished, with the text of exactly those tokens (the tool loop cut the ids of a
    longer reply and kept its whole text, which the env then scored). The row samples what it would
    have with the call's budget, up to its own."""
    tok = agents[0].tokenizer
    params = SamplingParams(max_new_tokens=12, temperature=0.5)
    short, long = (GenerationRequest("def f(x):", 0, 3, seed=11, max_new_tokens=b) for b in (4, None))
    both = HFBackend(agents, max_batch_rows=1).generate([short, long], params)
    assert [len(c.token_ids) <= 4 for c in both[0]] == [True] * 3
    for c in [*both[0], *both[1]]:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    for cut, whole in zip(both[0], both[1]):
        assert cut.token_ids == whole.token_ids[:4]
        assert cut.finished == (whole.finished and len(whole.token_ids) <= 4)


@pytest.mark.parametrize("rows", [["agent_0"] * 3 + ["agent_1"] * 3, ["agent_0"] * 4 + ["agent_1"] * 2],
                         ids=["batched", "per-slice"])
def test_routed_rows_in_bfloat16_get_the_logits_of_peft_forward_the_update_trains(agents, rows):
    """A bfloat16 model with float32 adapters (as models.py keeps them): each routed row's logits are those
    of peft's forward with its agent's adapter active (what the update computes), bit for bit. peft's forward
    adds the float32 LoRA sum to the layer's output and rounds once; rounding the sum to bfloat16 first (as
    peft's mixed batching does) moved these logits by up to 0.21, so the sampler's policy was not the one
    trained."""
    from magrpo.backends.hf import RowAdapters

    model = bfloat16_copy(agents, float_adapters=True)
    ids = torch.randint(3, 200, (len(rows), 7), generator=torch.Generator().manual_seed(2)).to(model.device)
    with torch.no_grad():
        trained = {}
        for name in set(rows):
            model.set_adapter(name)
            trained[name] = model(input_ids=ids).logits
        want = torch.stack([trained[name][i] for i, name in enumerate(rows)])
        with RowAdapters(model).active() as routing:
            got = model(input_ids=ids, **routing.rows(rows)).logits
    assert torch.equal(got, want)
