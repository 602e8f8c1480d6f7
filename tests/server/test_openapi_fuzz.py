"""Schema-driven fuzzing of the live server: schemathesis generates requests from /openapi.json (its
coverage phase: boundary and wrong-typed values for every field; then random ones) and checks that no
response is a server error and that every status, content type, header and body is the one the
document declares. Bounded (a short context keeps generations short); the invariant check runs after
every scheduler step, and the pool is accounted for afterwards."""

import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.conftest import accounting, assert_idle, make_engine, run, uvicorn_server

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance")


def _schemathesis() -> list[str]:
    exe = Path(sys.executable).with_name("schemathesis")
    return [str(exe)] if exe.exists() else [shutil.which("schemathesis") or "schemathesis"]


def test_fuzzed_requests_get_no_server_error_and_match_the_openapi_document(tiny_ckpt, tmp_path):
    engine = make_engine(tiny_ckpt, context_length=96, session_snapshot_dir=str(tmp_path / "snapshots"))
    with uvicorn_server(engine) as url:
        done = subprocess.run(
            [*_schemathesis(), "run", f"{url}/openapi.json", "--checks", CHECKS, "--phases", "coverage,fuzzing",
             "--max-examples", "8", "--generation-deterministic", "--request-timeout", "30", "--no-color"],
            capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        assert " passed" in done.stdout and "failures" not in done.stdout.split("SUMMARY")[-1]
        still = httpx.post(f"{url}/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert still.status_code == 200
        assert_idle(run(accounting(engine)))
