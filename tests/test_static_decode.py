"""The fixed-shape decode step (magrpo/backends/hf_graph.py) that `model.cuda_graphs` captures on a GPU: run
eagerly on a CPU, it samples what the eager loop samples, its per-step state lives in the tensors a graph
replays, and caches it cannot hold keep the eager loop."""
from __future__ import annotations

import pytest
import torch

from magrpo.backends.hf import decode
from magrpo.generation import SamplingParams
from magrpo.models import load_agents


@pytest.fixture(scope="module")
def agents():
    from tests.conftest import SMALL, compose

    torch.manual_seed(0)  # peft draws A from the global generator: the same adapters whatever ran before
    agents = load_agents(compose([*SMALL, "lora.r=4"]), 2)
    for name, param in agents[0].model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapters change something
            param.data.normal_(0, 0.2)
    return agents


def inputs(agents):
    """Prompts of 3 to 40 tokens for both agents, 3 samples each (rows grouped by agent, as HFBackend makes them)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 40, 17, 5)]
    adapters = [agents[0].adapter] * 2 + [agents[1].adapter] * 2
    return prompts, adapters, torch.arange(len(prompts)).repeat_interleave(3)


def run(agents, params, eos, **kwargs):
    prompts, adapters, expand = inputs(agents)
    with torch.no_grad():
        return decode(agents[0].model, prompts, adapters, expand, params, torch.arange(len(expand)), pad_id=0,
                      eos_ids=eos, **kwargs)


def ending_tokens(agents, params) -> list[int]:
    """EOS ids that end some rows early and leave others going: the tokens that the first two samples of the first
    and third prompts draw at their third step (a quarter of the rows or more end, so the eager loop drops rows)."""
    return run(agents, params, [-1]).tokens[[0, 1, 6, 7], 2].tolist()


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("ends", [False, True])
def test_a_static_decode_samples_what_the_eager_loop_does(agents, greedy, ends):
    """Both agents' adapters routed per row, left-padded prompts, and (`ends`) rows that finish early, so the
    eager loop drops rows: the same tokens, log-probs within float32 rounding (attention over the whole room's
    masked columns sums in another order)."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, logprobs=True, greedy=greedy)
    eos = ending_tokens(agents, params) if ends else [-1]
    eager, static = run(agents, params, eos), run(agents, params, eos, static=True)
    if ends:
        assert (eager.tokens[:, -1] == 0).sum() >= 3, "rows should finish early: the case is not tested"
    assert torch.equal(static.tokens, eager.tokens)
    finished = static.tokens == 0  # pad after an EOS: no log-prob to compare
    # float32 rounding scales with the log-prob: an AMX Xeon differed by 1.2e-5 at -4.7 (2.5e-6 relative)
    torch.testing.assert_close(static.logprobs[~finished], eager.logprobs[~finished], rtol=1e-5, atol=1e-5)


def test_each_step_reads_its_state_from_the_tensors_a_graph_replays(agents, monkeypatch):
    """A stand-in for CUDA's graph API that replays the captured forward the way a graph does: the same call,
    reading whatever the step's tensors hold then. The warm-ups, the capture and the replays give the eager
    loop's tokens only if every per-step input (token, mask column, position, cache column) is in those
    tensors and the warm-ups' writes are repeated by the replay. It cannot check CUDA's capture itself
    (tests/test_gpu.py does, on a GPU)."""
    from magrpo.backends import hf_graph

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            out = self.forward()
            self.out.copy_(out)  # a replay writes into the memory the capture allocated

    calls = {"capture": 0, "replay": 0, "forwards": 0}
    captured: list[Graph] = []

    class Capture:
        def __init__(self, graph):
            self.graph = graph
            captured.append(graph)

        def __enter__(self):
            calls["capture"] += 1

        def __exit__(self, *exc):
            return False

    real_forward = hf_graph.StaticStep._forward

    def forward(self):
        calls["forwards"] += 1
        out = real_forward(self)
        if captured and not hasattr(captured[-1], "forward"):  # inside the capture: record, as a graph would
            captured[-1].forward = lambda: real_forward(self)
            captured[-1].out = out
        return out

    replay = Graph.replay

    def counted(self):
        calls["replay"] += 1
        replay(self)

    monkeypatch.setattr(Graph, "replay", counted)
    monkeypatch.setattr(hf_graph.StaticStep, "_forward", forward)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: _Null())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    real_static_step = hf_graph.static_step
    monkeypatch.setattr(hf_graph, "static_step", lambda *args, capture: real_static_step(*args, capture=True))

    params = SamplingParams(max_new_tokens=10, temperature=1.0, logprobs=True)
    eos = ending_tokens(agents, params)
    eager, graphed = run(agents, params, eos), run(agents, params, eos, static=True)
    steps = graphed.tokens.shape[1]
    assert calls["capture"] == 1 and calls["replay"] == steps - 1  # captured once, replayed for every step
    assert calls["forwards"] == hf_graph.WARMUPS + 1  # then only replays of the recorded call
    assert torch.equal(graphed.tokens, eager.tokens)
    finished = graphed.tokens == 0
    torch.testing.assert_close(graphed.logprobs[~finished], eager.logprobs[~finished], rtol=0, atol=1e-5)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_cache_of_sliding_window_layers_keeps_the_eager_loop():
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    from magrpo.backends.hf_graph import column_room

    def filled(layer):
        layer.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))
        return layer

    column = torch.tensor([3])
    sliding = DynamicCache()
    sliding.layers = [filled(DynamicLayer()), filled(DynamicSlidingWindowLayer(sliding_window=8))]
    assert not column_room(sliding, 5, column)
    assert [type(layer) for layer in sliding.layers] == [DynamicLayer, DynamicSlidingWindowLayer]  # untouched
    plain = DynamicCache()
    plain.layers = [filled(DynamicLayer())]
    assert column_room(plain, 5, column)
    keys, _ = plain.layers[0].update(torch.full((2, 1, 1, 4), 2.0), torch.zeros(2, 1, 1, 4))
    assert keys.shape == (2, 1, 8, 4)  # the whole room, every step
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 0, 0, 0, 0]  # written at the column, the rest untouched


def test_the_backend_asks_for_the_static_step_only_on_a_cuda_device(make_cfg, monkeypatch):
    """model.cuda_graphs=true on a machine without CUDA (model.device=auto) decodes as before."""
    import magrpo.backends.hf as hf
    from magrpo.backends import make_backend
    from magrpo.generation import GenerationRequest

    asked = []
    real = hf.decode
    monkeypatch.setattr(hf, "decode", lambda *args, **kwargs: asked.append(kwargs["static"]) or real(*args, **kwargs))
    cfg = make_cfg("model.cuda_graphs=true")
    (agent,) = load_agents(cfg, 1)
    backend = make_backend(cfg, [agent])
    assert backend.cuda_graphs
    backend.generate([GenerationRequest("a", 0, 2, seed=1)], SamplingParams(max_new_tokens=2))
    assert asked == [torch.cuda.is_available()]


@pytest.mark.parametrize("setting, message", [
    ("model.device=cpu", "config error: model.cuda_graphs: needs a CUDA device, but model.device=cpu"),
    ("backend=vllm", "config error: model.cuda_graphs: is the HF backend's; vLLM captures its own graphs with "
                     "vllm.enforce_eager=false"),
])
def test_cuda_graphs_where_they_cannot_run_is_one_line(run_cli, setting, message):
    from tests.conftest import SMALL

    code, lines = run_cli(*SMALL, "model.cuda_graphs=true", setting)
    assert code == 2 and lines == [message]
