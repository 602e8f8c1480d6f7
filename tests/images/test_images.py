"""Both images built from this checkout by scripts/build_images.sh and run here (tests/images/buildah.py):

- the server image serves its bundled model on the CPU, as the non-root user, from its own
  ENTRYPOINT and CMD (only the address changed), and answers a completion;
- the operator image has no torch, renders sessions against the CRDs it carries, and, started with
  the command and args the Helm chart renders, serves its health endpoint and metrics while it
  reconciles a session against kmock's API emulator, giving the server pods the server image.

Slow (measured on this project's 2-core machine, shared with other work): about 14 minutes the first
time (debootstrap, the torch base, both builds), 2.5 to 7 once the bases are cached.
"""

from __future__ import annotations

import httpx
import pytest
import yaml

from mambaserve.operator import names
from mambaserve.operator.builders.server import HOME_DIR
from mambaserve.operator.settings import SERVER_PORT
from tests.charts.conftest import render
from tests.charts.live_stack import Emulator, free_port, wait_http
from tests.images.buildah import Buildah, torch_pin, why_not
from tests.operator.conftest import SAMPLES, sample

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(why_not() is not None, reason=why_not() or "")]

NON_ROOT = "65532:65532"


def test_server_image_serves_the_bundled_model_on_cpu(buildah: Buildah, images: tuple[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    server, _ = images
    config = buildah.config(server)
    assert config["User"] == NON_ROOT and config["Entrypoint"] == ["mambaserve", "serve"]
    assert f"{SERVER_PORT}/tcp" in config["ExposedPorts"] and f"HOME={HOME_DIR}" in config["Env"]
    cmd = config["Cmd"]
    model = cmd[cmd.index("--model") + 1]
    assert model == "/models/mamba2-tiny-pystdlib"

    with buildah.container(server) as ctr:
        assert ctr.run(["id", "-u"]).stdout.strip() == "65532"
        versions = ctr.run(["python3", "-c", "import torch; print(torch.__version__)"])
        assert versions.stdout.strip().split("+")[0] == torch_pin(), versions.stderr
        port = free_port()
        # The image's own entrypoint and command; a later --host/--port wins (loopback, a free port).
        proc = ctr.start([*config["Entrypoint"], *cmd, "--host", "127.0.0.1", "--port", str(port)],
                         tmp_path / "server.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{url}/health", 300, proc)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{(tmp_path / 'server.log').read_text()[-3000:]}") from e
        info = httpx.get(f"{url}/get_model_info", timeout=30).json()
        assert info["model_path"] == model
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == "mamba2-tiny-pystdlib" and body["choices"][0]["text"].strip()
        assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


# The emulator's loop (tests/charts/live_stack.py) stops with kmock's watch feeders still pending.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_operator_image_has_no_torch_and_runs_as_the_chart_starts_it(  # type: ignore[no-untyped-def]
        buildah: Buildah, images: tuple[str, str], tmp_path) -> None:
    server, operator = images
    config = buildah.config(operator)
    assert config["User"] == NON_ROOT and config["Entrypoint"] == ["mambaserve-operator"]
    assert "USER=mambaserve" in config["Env"]  # Kopf calls getpass.getuser() at start

    with buildah.container(operator) as ctr:
        engine = ("torch", "transformers", "triton", "mambaserve.operator")
        probe = ctr.run(["python", "-c", f"import importlib.util as u; print([m for m in {engine} if u.find_spec(m)])"])
        assert probe.stdout.strip() == "['mambaserve.operator']", probe.stdout + probe.stderr

        rendered = ctr.run(["mambaserve-operator", "render", "-f", "/samples/inferencesession-minimal.yaml",
                            "--server-image", server], volumes=[f"{SAMPLES}:/samples:ro"])
        assert rendered.returncode == 0, rendered.stderr
        (deployment,) = [o for o in yaml.safe_load_all(rendered.stdout) if o and o["kind"] == "Deployment"]
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == server

        # The operator container exactly as the chart renders it for these two images.
        (s_repo, s_tag), (o_repo, o_tag) = server.rsplit(":", 1), operator.rsplit(":", 1)
        chart = render({"server": {"image": {"repository": s_repo, "tag": s_tag}},
                        "operator": {"image": {"repository": o_repo, "tag": o_tag}}})
        container = chart.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == operator
        emulator = Emulator()
        try:
            health, metrics = free_port(), free_port()
            # POD_NAMESPACE comes from the downward API in a pod: the Lease's namespace is given here instead.
            proc = ctr.start([*container["command"], *container["args"], f"--api-server={emulator.url}",
                              f"--health-port={health}", f"--metrics-port={metrics}",
                              "--leader-election-namespace=mambaserve-system"], tmp_path / "operator.log")
            try:
                wait_http(f"http://127.0.0.1:{health}/healthz", 120, proc)
                emulator.call(emulator.cluster.create(sample("inferencesession-minimal")))
                emulator.eventually(lambda: emulator.get("Deployment", names.workload("tiny")) is not None,
                                    "create the server Deployment of the session")
            except (RuntimeError, TimeoutError) as e:
                raise AssertionError(f"{e}\n{(tmp_path / 'operator.log').read_text()[-3000:]}") from e
            pod = emulator.get("Deployment", names.workload("tiny"))["spec"]["template"]["spec"]
            assert pod["containers"][0]["image"] == server
            assert "mambaserve_operator_reconciles_total" in httpx.get(
                f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        finally:
            emulator.close()
