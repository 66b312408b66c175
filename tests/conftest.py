import os

os.environ.setdefault("USE_HUB_KERNELS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels can only run in the interpreter; set it before any test module
# (the engine's, the kernels') imports triton, whatever the collection order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny model (random, seeded, every layer kind, with its tokenizer), made once per session at
    `<tmp>/models/tiny-m3` (the name the shipped model.json files use, under $M3SERVE_MODEL_DIR)."""
    from m3serve.model.tiny import make_tiny

    d = tmp_path_factory.mktemp("models") / "tiny-m3"
    make_tiny(str(d))
    return str(d)


@pytest.fixture
def tokenizer_loads(monkeypatch):
    """Every `Tokenizer` this process makes while the test runs: built (`from_pretrained` builds one) or unpickled
    (shipped here from another process). With the engine in a process of its own, that process alone loads it."""
    from m3serve.text.tokenizer import Tokenizer

    loads, init = [], Tokenizer.__init__

    def counting_init(self, *args, **kwargs):
        loads.append("built")
        init(self, *args, **kwargs)

    def counting_setstate(self, state):
        loads.append("unpickled")
        self.__dict__.update(state)
    monkeypatch.setattr(Tokenizer, "__init__", counting_init)
    monkeypatch.setattr(Tokenizer, "__setstate__", counting_setstate, raising=False)
    return loads


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":  # every allocation a cudaMalloc, none while capturing
        no_capture = pytest.mark.skip(reason="captures a CUDA graph: needs PyTorch's caching allocator")
        for item in items:
            if "cuda_graph" in item.keywords:
                item.add_marker(no_capture)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_RUNNING: list[str] = []  # the test in progress (one at a time per process)


def pytest_runtest_logstart(nodeid, location):
    _RUNNING[:] = [nodeid]


def pytest_runtest_logfinish(nodeid, location):
    _RUNNING.clear()


def pytest_keyboard_interrupt(excinfo):
    """An interrupted run (tests/run_suite.py stops its processes so at a timeout) names the test it was in; `-q`
    alone prints only the deepest frame, somewhere in torch."""
    if _RUNNING:
        print(f"\ninterrupted in {_RUNNING[0]}", flush=True)
