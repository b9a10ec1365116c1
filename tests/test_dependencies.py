"""The locked runtime dependencies (uv.lock, without the dev group) against PyPI's vulnerability records
(pip-audit): a known vulnerability that has a fixed release fails the suite, naming the package, the advisory and
the versions that fix it. One without a fix yet is printed, not failed (there is nothing to upgrade to)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_locked_runtime_dependencies_have_no_fixable_known_vulnerability(tmp_path):
    requirements, report = tmp_path / "requirements.txt", tmp_path / "audit.json"
    uv = os.environ.get("UV", "uv")  # `uv run` names its own binary
    subprocess.run([uv, "export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project", "-o", str(requirements)],
                   cwd=ROOT, check=True, capture_output=True)
    audit = subprocess.run([sys.executable, "-m", "pip_audit", "-r", str(requirements), "--no-deps", "--disable-pip",
                            "--vulnerability-service", "pypi", "--format", "json", "--progress-spinner", "off",
                            "--output", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert report.exists(), f"pip-audit did not run (exit {audit.returncode}):\n{audit.stderr[-2000:]}"
    deps = json.loads(report.read_text())["dependencies"]
    assert len(deps) > 20, "the export listed almost nothing: the audit would prove nothing"
    fixable, unfixed = [], []
    for dep in deps:
        for v in dep.get("vulns", []):
            fixed_in = ", ".join(v["fix_versions"]) or "nothing yet"
            line = f"{dep['name']} {dep['version']}: {v['id']} (fixed in {fixed_in})"
            (fixable if v["fix_versions"] else unfixed).append(line)
    if unfixed:
        print("known vulnerabilities without a fixed release:\n  " + "\n  ".join(unfixed))
    assert not fixable, "upgrade these locked dependencies (uv lock --upgrade-package NAME):\n  " + "\n  ".join(fixable)
