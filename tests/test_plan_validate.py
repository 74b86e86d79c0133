"""benchmarks/plan_validate.py's judging, end to end, on a simulated "reality" (no server): `--rejudge` of a
saved run's folders calibrates the given profile on its calibration runs and compares the simulation with its
judged sweeps."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from conftest import sim_bench_folder
from tokenloom.plan.cost_model import FEATURES, LinearStepCost
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.simulator import FleetConfig

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_validate", ROOT / "benchmarks" / "plan_validate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rejudge_of_a_simulated_reality_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coef = (0.004, 2e-4, 3e-4) + (0.0,) * (len(FEATURES) - 3)
    bare = Profile("measured", "fake", LinearStepCost(coef), 16, 2000, 1000.0, 16, 256, 4096)
    # "Reality": the bare cost plus serving terms the calibration must find.
    real = replace(bare, overhead_step_s=0.002, overhead_row_s=0.0003, request_s=0.03, response_s=0.005,
                   router_hop_s=0.02, router_token_s=0.001)
    run = tmp_path / "run"
    run.mkdir()
    single, cluster = FleetConfig(workers=1), FleetConfig(workers=2)

    def folder(path: Path, prof: Profile, fleet: FleetConfig, loads: list[tuple[float, int | None]],
               seed: int) -> None:
        sim_bench_folder(path, prof, fleet, loads, num_prompts=40, output_len=24, seed=seed)

    folder(run / "calibration-single", real, single, [(0.2, 1)], seed=1)
    folder(run / "calibration-single-loaded", real, single, [(40.0, 8)], seed=2)
    folder(run / "calibration-cluster-2", real, cluster, [(0.2, 1)], seed=3)
    folder(run / "calibration-cluster-2-loaded", real, cluster, [(60.0, 8)], seed=4)
    for i in range(2):
        folder(run / f"single-r{i}", real, single, [(5.0, None), (20.0, None)], seed=10 + i)
        folder(run / f"cluster-2-r{i}", real, cluster, [(10.0, None), (40.0, None)], seed=20 + i)
    prof_path = tmp_path / "bare.json"
    bare.save(prof_path)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["plan_validate.py", "--rejudge", str(run), "--profile", str(prof_path),
                                      "--setups", "single,cluster-2", "--no-step-trace", "--input-len", "64",
                                      "--output-len", "24", "--out", str(out)])
    _script().main()
    rows = json.loads((out / "validation.json").read_text())["median"]
    assert {(r["setup"], r["rate"]) for r in rows} == {("single", 5.0), ("single", 20.0), ("cluster-2", 10.0),
                                                        ("cluster-2", 40.0)}
    for r in rows:  # the same arrivals replayed on a profile calibrated to that reality: close to exact
        for k in ("ttft_s_median", "tpot_s_median"):
            assert abs(r[f"err_{k}"]) < 0.1, (r["setup"], r["rate"], k, r[f"err_{k}"])
    calibrated = Profile.load(out / "profile-calibrated.json")
    assert calibrated.request_s == pytest.approx(0.03, rel=0.3)
    assert calibrated.router_hop_s == pytest.approx(0.02, rel=0.3)
    assert "figures below the measured knee within 20%" in (out / "table.md").read_text()
    # Without the run's calibration folders it refuses, naming the folder.
    monkeypatch.setattr(sys, "argv", ["plan_validate.py", "--rejudge", str(tmp_path / "none"), "--profile",
                                      str(prof_path), "--setups", "single", "--out", str(out)])
    with pytest.raises(SystemExit, match="no calibration runs"):
        _script().main()
