"""Re-measure alone (nothing else running) trial stages that sweeps/dense_search calibrated beside a
running trial, with the same method and rounds, and print both ratios to the base config's step.

    python sweeps/search_cost_check.py 21 7 11      (trial numbers; writes /tmp/search_cost_check/)
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import optuna  # noqa: E402

import search  # noqa: E402
import sweep  # noqa: E402

st = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(ROOT / "sweeps/dense_search/study.journal")))
study = optuna.load_study(study_name="dense_search-aed44c44", storage=st)
picked = [int(n) for n in sys.argv[1:]]
trials = {t.number: t for t in study.trials}
spec = sweep.load_sweep(ROOT / "sweeps/dense_search.yaml")
variants = {"base": [], **{f"t{n}": trials[n].user_attrs["overrides"] for n in picked}}
s = dict(name="alone_check", config="configs/cpu.yaml", seeds=[0], overrides=search.common_overrides(spec), baseline="base",
         variants=variants, variant_configs={}, out=Path("/tmp/search_cost_check"), ablation=False, clock="calibrated")
runner = sweep.Sweep(s, [], nproc=1, jobs=2, rounds=4)
runner.calibrate()
alone = json.loads(runner.calibration.read_text())["stages"]
beside = json.loads(ROOT / "sweeps/dense_search/calibration-aed44c44.json".read_text())["stages"]
for key, st_ in alone.items():
    b = beside.get(key)
    print(f"{st_['name']}: alone x{st_['ratio']:.4f} (se {st_['se']:.1%})", f"beside x{b['ratio']:.4f} (se {b['se']:.1%}) [{b['name']}]" if b else "-",
          f"alone/beside {st_['ratio'] / b['ratio']:.4f}" if b else "")
