"""Shared fixtures: a composed, shrunk config for end-to-end tests on the tiny model (CPU, seconds)."""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import traceback
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (.ci/run: one worker per core) each worker, and every process it starts, gets one
# intra-op thread: the workers fill the cores, and two spinning OpenMP threads per process fighting
# for them made a 20 s learning test take up to 330 s (docs/benchmarks.md, "Test suite").
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny models (`pytestmark = pytest.mark.usefixtures(...)`): extra
    threads only spin-wait, 100x slower on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def same_random_state_in_every_run():
    """Each test starts from seed 0 (torch, numpy, random). torch 2.13 seeds its default generator at
    random in each process (torch.initial_seed() differs run to run), so a test that drew from it
    without seeding saw new numbers every run: a rare draw failed once and passed on the rerun. Now
    a failure repeats. Module- and session-scoped fixtures run before this one and seed themselves."""
    seed_everything(0)


ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `tests.feedback_probe` and train.py's packages import from the root
    sys.path.insert(0, str(ROOT))

import magrpo.envs  # noqa: E402  (fills the env registry)
import magrpo.external  # noqa: E402,F401  (fills the feedback registry)
from magrpo.cli import compose  # noqa: E402
from magrpo.trainer import seed_everything  # noqa: E402
from tests.openai_server import server  # noqa: E402,F401  (fixture: an OpenAI-compatible HTTP server)

SMALL = [
    "env=length_ratio",  # the fast toy env and tiny model, not the SmolLM2 code-env default
    "model=tiny",
    "model.dtype=float32",  # not auto: a CPU with a bf16 fast path would otherwise change every number
    "external=length_ratio",
    "logging.progress=false",
    "trainer.steps=2",
    "trainer.batch_size=2",
    "trainer.num_generations=2",
    "generation.max_new_tokens=6",
    "eval.max_problems=2",
    "eval.num_samples=2",
    "logging.wandb.mode=disabled",  # tests that check wandb turn it on
]


BENCH = ROOT / "bench"


def load_bench(name: str):
    """bench/<name>.py as the benchmarks import one another (bench/ on sys.path, one module per name):
    a plugin it registers is then registered once, and dataclasses find their module."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def experiment_module(name: str):
    """experiments/<name>.py as a module (a generator: the fixture's teardown forgets it again)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


LOCAL_HOSTS = {None, "", "localhost", "127.0.0.1", "::1", "0.0.0.0"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every test runs offline: the hub libraries are in offline mode even when they were imported before
    HF_HUB_OFFLINE was set (they read it once, at import), and a test that looks up or connects to another
    machine fails at teardown, even where the code under test swallows the error (no network here
    would otherwise hide an attempt that downloads elsewhere). Processes the tests start get the env var."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            monkeypatch.setattr(sys.modules[module], "HF_HUB_OFFLINE", True)
    tried: list[str] = []

    def refuse(host, port) -> None:
        # who asked: another thread (a library's background worker) may outlive the test that started it
        caller = traceback.extract_stack()[-4]
        tried.append(f"{host}:{port} (thread {threading.current_thread().name}, "
                     f"{caller.filename}:{caller.lineno} {caller.name})")
        raise OSError(f"tests are offline: {host}:{port} refused")

    real_getaddrinfo = socket.getaddrinfo
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in LOCAL_HOSTS:
            refuse(host, port)
        return real_getaddrinfo(host, port, *args, **kwargs)

    def remote(sock, address) -> bool:
        return sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL_HOSTS

    def connect(sock, address):
        if remote(sock, address):
            refuse(*address[:2])
        return real_connect(sock, address)

    def connect_ex(sock, address):
        if remote(sock, address):
            refuse(*address[:2])
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield
    assert not tried, f"the test tried the network: {', '.join(tried)}"


def wait_for(path: Path, proc, timeout: float = 300) -> None:
    """Until `path` exists, while the process `proc` (a subprocess.Popen) runs; its stderr when it ended."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg("trainer.joint_mode=cross", ...) -> TrainConfig writing into tmp_path/run."""

    def make(*overrides: str):
        return compose([*SMALL, f"logging.run_dir={tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture
def pinned_train(tmp_path):
    """pinned_train("trainer.steps=8", ...) -> the run dir of a training run (SMALL + overrides) in a child
    process pinned to portable kernels (magrpo.pinned): a test that asserts a training outcome must get
    the same numbers on every CPU kind, not only on the one it was tuned on (docs/testing.md)."""
    from magrpo import pinned

    def run(*overrides: str) -> Path:
        run_dir = tmp_path / "run"
        proc = pinned.run([*SMALL, f"logging.run_dir={run_dir}", *overrides], env={"HF_HUB_OFFLINE": "1"},
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return run_dir

    return run


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys):
    """run_cli(*argv) -> (exit code, non-blank stderr lines) of `train.py argv`, in-process, in tmp_path
    (the default run dir lands there). Loading a model fails the test: every bad input must stop before."""
    import torch

    import magrpo.models
    from magrpo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / ".hf"))
    monkeypatch.setenv("MAGRPO_CACHE", str(tmp_path / ".cache"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc holding a wandb key
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setattr(magrpo.models, "load_agents", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # model.device=cuda fails on GPU machines too

    def run(*argv: str) -> tuple[int, list[str]]:
        code = main(list(argv))
        return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]

    return run


@pytest.fixture(scope="module")
def truncate_env():
    """The code env whose train split is HumanEval/2 (`truncate_number`, 3 test cases), shipped copy."""
    from magrpo.envs.code.env import CodeEnv

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # the shipped copy, never the hub
    yield CodeEnv(CodeEnv.Config(train_split="test[2:3]", eval_split="test[3:4]"))
    mp.undo()
