"""bench.lm's cache of runs: a cached run says which code made it, so a table
never passes off a run of older code as one of today's."""
import json
import types

from bench import lm
from examples.train_lm import LMResult


def test_a_cached_run_records_its_code_and_a_table_reports_it(tmp_path):
    args = types.SimpleNamespace(steps=3, lr=1e-3, freeze_step=1, batch=2, eval_every=1, size="small",
                                 out=str(tmp_path))
    made = []
    lm.RUNS_MADE_AT.clear()
    first = lm.cached(args, {"kind": "test"}, lambda: made.append(1) or LMResult("m", 2, 3, test_loss=1.5))
    again = lm.cached(args, {"kind": "test"}, lambda: made.append(1) or LMResult("m", 2, 3, test_loss=9.0))
    assert made == [1] and first.test_loss == again.test_loss == 1.5  # the second is read back, not run
    (saved,) = (tmp_path / "cache").iterdir()
    code = json.loads(saved.read_text())["code"]
    assert code == lm.code_version() and code.split("+")[0] not in ("", "unknown")
    assert lm.RUNS_MADE_AT == {code}
    # a run cached before the code was recorded says so
    data = json.loads(saved.read_text())
    del data["code"]
    saved.write_text(json.dumps(data))
    lm.RUNS_MADE_AT.clear()
    lm.cached(args, {"kind": "test"}, lambda: LMResult("m", 2, 3))
    assert lm.RUNS_MADE_AT == {"not recorded"}
