"""core/environment.py: the record of what a run ran under, and the differences named on resume and --compare."""

from __future__ import annotations

import ast
import copy
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from core import environment as env_mod
from core.environment import differences, environment, json_line, package_version, source_commit


def test_environment_records_installed_versions_and_is_json():
    env = environment()
    assert env["packages"]["torch"] == torch.__version__
    assert set(env["packages"]) == set(env_mod.PACKAGES)
    assert env["device"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name())
    assert json.loads(json.dumps(env)) == env
    assert package_version("no-such-distribution-hybrid-distill") is None


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})


def test_source_commit_names_the_checkout_and_marks_changed_tracked_files(tmp_path):
    assert source_commit(tmp_path) is None  # not a checkout (e.g. an installed wheel)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == head + "+dirty"


def test_differences_name_what_changed_and_only_that():
    a = environment()
    assert differences(a, copy.deepcopy(a)) == []
    a["packages"]["gguf"] = "0.10.0"
    b = copy.deepcopy(a)
    b["packages"]["transformers"], b["packages"]["gguf"], b["platform"] = "0.0.1", None, "another kernel"
    b["commit"] = "abc"
    assert differences(a, b) == [f"commit {a['commit']} -> abc", "gguf 0.10.0 -> absent",
                                 f"transformers {a['packages']['transformers']} -> 0.0.1"]  # not the OS string
    assert differences(None, a) == differences(a, {}) == []  # an older checkpoint or log has no record


def test_json_line_is_the_result_with_the_environment_it_ran_under():
    result = {"ppl": 64.43, "arms": {"off": [1, 2]}, "target_met": False}
    assert json.loads(json_line(result)) == {**result, "environment": environment()}
    assert "environment" not in result  # the caller's dict is left as it was


def test_json_line_writes_what_was_not_measured_as_null_at_any_depth():
    """NaN and the infinities are not JSON: jq and other strict readers refuse a line holding them."""
    result = {"cost": math.nan, "arms": {"off": {"cos": -math.inf, "ppl": 64.4}, "rows": [1.5, math.inf, (math.nan, 2)]},
              "steps": 3, "name": "mix", "flag": True}
    line = json_line(result)
    back = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the JSON line"))
    assert back["cost"] is None and back["arms"]["off"] == {"cos": None, "ppl": 64.4}
    assert back["arms"]["rows"] == [1.5, None, [None, 2]]
    assert (back["steps"], back["name"], back["flag"]) == (3, "mix", True)
    assert math.isnan(result["cost"]) and result["arms"]["rows"][1] == math.inf  # the caller's dict is left as it was


def test_every_benchmark_prints_its_result_through_json_line():
    """A benchmark's last line is its result: each script under bench/ prints it through json_line, so every
    number it reports says which install and commit measured it (bench/patterns.py is a module, and
    bench/locustfile.py a load profile for locust, not scripts)."""
    scripts = [p for p in sorted((Path(__file__).resolve().parents[1] / "bench").glob("*.py"))
               if '__name__ == "__main__"' in p.read_text() and p.name != "locustfile.py"]
    assert len(scripts) >= 19
    for path in scripts:
        calls = {node.func.id for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "json_line" in calls, f"{path.name} prints its JSON line without json_line"
