"""benchmarks/selection_overlap.py on the learned checkpoint (CPU, a few prompts): a 1-token tile visits exactly the
blocks its token needs, larger tiles visit more per block needed (never fewer), on the model's selections and on
the same tokens' random ones, and tiles are counted only where the selection is selective."""
import importlib
import json


def test_selection_overlap_small(tmp_path):
    bench = importlib.import_module("selection_overlap")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
    out = tmp_path / "overlap.json"
    assert bench.main(["--n", "2", "--tasks", "retrieval,arithmetic", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["task"], r["selections"]): r for r in res["rows"]}
    for kind in ("learned", "random"):
        r = rows[("retrieval", kind)]
        ratios = [r[f"tile{t}"] for t in bench.TILES]
        assert ratios[0] == 1.0 and ratios == sorted(ratios) and ratios[-1] > 1.0
        assert r["tiles_counted"]["1"] > 0
        short = rows[("arithmetic", kind)]  # short prompts: every block is selected, nothing counted
        assert short["tiles_counted"]["1"] == 0 and short["tile1"] is None
