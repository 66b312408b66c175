"""Both engines a caller may hold implement `EngineClient` (engine/client.py) member for member, with the same
parameters: the Triton model drives either through that one interface."""
import inspect

import pytest

from m3serve.engine.async_engine import AsyncLLMEngine
from m3serve.engine.client import EngineClient
from m3serve.engine.process_client import EngineProcess


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
    assert set(_members()) == {"max_model_len", "prepare", "submit", "generate", "abort", "abort_sync", "stats",
                               "is_healthy", "dead_reason", "shutdown"}


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
