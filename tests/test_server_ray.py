"""cism on Ray Serve: a local Ray instance with two replicas serves
concurrent requests, both replicas take traffic, and every answer equals the
single-process server's (seeded sampling, bit for bit in the logprobs)."""
import concurrent.futures
import shutil
import tempfile

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

import cism
from cism.server import create_app

from serving import LiveServer


def ask(url, i):
    body = {"model": "smol", "prompt": f"Question {i}: what is the capital of France?", "max_tokens": 12,
            "temperature": 0.8, "seed": i, "logprobs": 1}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return r.headers["x-cism-server"], c["text"], c["logprobs"]["token_logprobs"]


def test_two_replicas_share_the_traffic_and_answer_as_one_server(smollm2_gguf):
    from ray import serve

    from cism.server.ray import deployment
    model = cism.load(str(smollm2_gguf), precision="int8", threads=1)
    engine = cism.Engine(model, kv_blocks=128)
    single = LiveServer(create_app(engine, model_name="smol"))
    try:
        want = [ask(single.url, i)[1:] for i in range(12)]
    finally:
        single.stop()
        engine.shutdown(drain=False)
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")   # (Ray's socket paths must stay short)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        from cism.server.ray import build   # what `serve run cism.server.ray:build key=value...` calls
        app = build({"model": str(smollm2_gguf), "model_name": "smol", "precision": "int8", "threads": "1",
                     "replicas": "2", "kv_blocks": "128"})
        serve.run(app, name="cism", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: ask(url, i), range(12)))
        assert len({g[0] for g in got}) == 2          # both replicas answered
        assert [g[1:] for g in got] == want
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)



def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cism_serve_ray_cli(smollm2_gguf):
    """`cism serve --ray --replicas 2`: prints its URL, answers, stops on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_TMPDIR=temp)
    p = subprocess.Popen([sys.executable, "-m", "cism.cli", "serve", "--ray", "--replicas", "2", "--port", str(port),
                          "--model", str(smollm2_gguf), "--precision", "int8", "--model-name", "smol",
                          "--kv-blocks", "64", "--threads", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "serving smol" not in line:
            line = p.stderr.readline()
            assert line or p.poll() is None, "cism serve --ray exited"
        assert f"at http://127.0.0.1:{port}/" in line and "2 replicas" in line
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_application_builder_names_a_bad_argument():
    from cism.server.ray import build
    with pytest.raises(ValueError, match="replica"):
        build({"model": "m.gguf", "replica": "2"})     # a typo of replicas
    with pytest.raises(ValueError, match="model=PATH"):
        build({"replicas": "2"})
