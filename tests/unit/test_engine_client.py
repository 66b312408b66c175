"""Both engines a caller may hold implement `EngineClient` (engine/client.py) member for member, with the same
parameters: the Triton model drives either through that one interface."""
import inspect

import pytest

from m3serve.engine.async_engine import AsyncLLMEngine
from m3serve.engine.client import EngineClient
from m3serve.engine.process_client import EngineProcess
from m3serve.engine.sampling_params import InvalidRequest


def _members() -> list[str]:
    return sorted(n for n, v in vars(EngineClient).items()
                  if not n.startswith("_") and (callable(v) or isinstance(v, property)))


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def mismatches(cls) -> list[str]:
    """Protocol members `cls` lacks, or has with other parameters (names and kinds), or as another kind of member."""
    out = []
    for name in _members():
        want, have = inspect.getattr_static(EngineClient, name), inspect.getattr_static(cls, name, None)
        if have is None:
            out.append(f"{name}: missing")
        elif isinstance(want, property) != isinstance(have, property):
            out.append(f"{name}: {'a property' if isinstance(want, property) else 'a method'} in the protocol")
        elif not isinstance(want, property):
            if _params(want) != _params(have):
                out.append(f"{name}: {_params(have)} != {_params(want)}")
            elif inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
                out.append(f"{name}: async in one, not in the other")
    return out


def test_the_protocol_names_the_interface():
    assert set(_members()) == {"max_model_len", "prepare", "submit", "start", "generate", "abort", "abort_sync",
                               "stats", "is_healthy", "dead_reason", "shutdown"}


@pytest.mark.parametrize("cls", [AsyncLLMEngine, EngineProcess])
def test_each_engine_implements_every_member_with_the_same_parameters(cls):
    assert mismatches(cls) == []


def test_a_missing_or_different_member_is_reported():
    class Partial(AsyncLLMEngine):
        abort_sync = None  # gone

        def stats(self, detail):  # another parameter
            return {}

        async def is_healthy(self):  # async where the protocol is not
            return True

    found = mismatches(Partial)
    assert [m.split(":")[0] for m in found] == ["abort_sync", "is_healthy", "stats"]


def test_an_abort_while_a_start_is_prepared_is_applied_once_submitted():
    """PendingStarts (both engines' `start`): an abort that comes before the request is submitted is applied right
    after; a failure to prepare (a cancelled preparation included) or to submit is the request's one event; a
    request never started is left alone."""
    from concurrent.futures import Future

    from m3serve.engine.client import PendingStarts

    starts, calls = PendingStarts(lambda: RuntimeError("shut down")), []

    def run(rid, prepared=None, error=None, submit_error=None, cancel=False):
        def submit(p):
            if submit_error is not None:
                raise submit_error
            calls.append(("submit", rid, p))
        fut = Future()
        if cancel:
            fut.cancel()
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(prepared)
        starts.prepared(rid, fut, submit, lambda e: calls.append(("fail", rid, str(e))),
                        lambda: calls.append(("abort", rid)))

    for rid in "abcde":
        starts.begin(rid)
    with pytest.raises(InvalidRequest, match="already running"):
        starts.begin("a")
    starts.abort("a")
    starts.abort("never started")  # nothing kept for it
    run("a", "A")
    run("b", "B")
    run("c", error=ValueError("bad option"))
    starts.abort("d")
    run("d", "D", submit_error=RuntimeError("already running"))
    run("e", cancel=True)  # the engine shutting down
    assert calls == [("submit", "a", "A"), ("abort", "a"), ("submit", "b", "B"), ("fail", "c", "bad option"),
                     ("fail", "d", "already running"), ("fail", "e", "shut down")]
    starts.abort("a")  # after its start: the engine's own abort does the work
    assert starts._aborted == {}
