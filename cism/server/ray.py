"""cism on Ray Serve: every replica holds one model and its engine and
serves the same routes as `cism serve`, behind Serve's HTTP proxy.

One machine (Serve starts a local Ray instance):

    cism serve --ray --replicas 2 --model model.gguf --precision int8 --port 8000

or Ray's own CLI (an application builder):

    serve run cism.server.ray:build model=model.gguf precision=int8 replicas=2

or in Python:

    from ray import serve
    from cism.server.ray import deployment
    serve.run(deployment("model.gguf", precision="int8", num_replicas=2), route_prefix="/")

A cluster: ``ray start --head`` on one machine, ``ray start --address=HEAD:6379``
on the others, then the same command on the head (it joins the running
cluster; Serve places replicas on any node with free CPUs). Replicas can also
autoscale: ``deployment(..., autoscaling_config={"min_replicas": 1,
"max_replicas": 8, "target_ongoing_requests": 16})``. Every node needs the
model file at the same path (or pass a path on shared storage).
"""
import os
import sys
import time

try:
    from ray import serve
except ImportError as e:   # an optional extra
    raise ImportError('cism.server.ray needs Ray Serve: pip install "cism[ray]"') from e


@serve.deployment(ray_actor_options={"num_cpus": 1})
@serve.ingress()
class CismReplica:
    """One replica: a model, its engine, and the app of cism.server."""

    def __init__(self, model_path, model_name, model_options, engine_kwargs, api_key=None):
        import cism
        options = {k: v for k, v in (model_options or {}).items() if v is not None}
        if options.get("kv_precision") == "fp32":
            options.pop("kv_precision")
        self.model = cism.load(model_path, **options)
        self.engine = cism.Engine(self.model, **(engine_kwargs or {}))
        self.model_name = model_name
        self.api_key = api_key

    def __serve_build_asgi_app__(self):
        from cism.server.app import create_app
        return create_app(self.engine, model_name=self.model_name, api_key=self.api_key)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(drain=False, timeout=10)


def deployment(model_path, *, model_name=None, api_key=None, engine_kwargs=None, num_replicas=1,
               autoscaling_config=None, num_cpus=1, **model_options):
    """A bound Ray Serve application of cism replicas (pass it to serve.run)."""
    name = model_name or os.path.splitext(os.path.basename(os.path.normpath(model_path)))[0]
    opts = {"ray_actor_options": {"num_cpus": num_cpus}}
    if autoscaling_config is not None:
        opts["autoscaling_config"] = autoscaling_config
    else:
        opts["num_replicas"] = num_replicas
    return CismReplica.options(**opts).bind(os.path.abspath(model_path), name, model_options,
                                            engine_kwargs or {}, api_key)


def build(args):
    """The application builder of Ray's own CLI:

        serve run cism.server.ray:build model=model.gguf precision=int8 replicas=2

    Arguments (strings): model (required), model_name, precision,
    act_precision, kv_precision, threads, replicas, num_cpus (per
    replica), max_seqs, kv_blocks, api_key."""
    args = dict(args)
    known = {"model", "model_name", "precision", "act_precision", "kv_precision", "threads", "replicas",
             "num_cpus", "max_seqs", "kv_blocks", "api_key"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if "model" not in args:
        raise ValueError("serve run cism.server.ray:build needs model=PATH")
    model_options = {k: args[k] for k in ("precision", "act_precision", "kv_precision") if k in args}
    if "threads" in args:
        model_options["threads"] = int(args["threads"])
    engine_kwargs = {k: int(args[k]) for k in ("max_seqs", "kv_blocks") if k in args}
    return deployment(args["model"], model_name=args.get("model_name"), api_key=args.get("api_key"),
                      engine_kwargs=engine_kwargs, num_replicas=int(args.get("replicas", 1)),
                      num_cpus=float(args.get("num_cpus", 1)), **model_options)


def serve_ray(model_path, *, model_name, host, port, replicas, api_key, model_options, engine_kwargs,
              out=sys.stderr):
    """`cism serve --ray`: run the replicas behind Serve's proxy until interrupted."""
    import signal

    import ray
    if port == 0:
        raise ValueError("--ray needs a fixed --port (Serve's proxy listens on it)")

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    app = deployment(model_path, model_name=model_name, api_key=api_key, engine_kwargs=engine_kwargs,
                     num_replicas=replicas, **model_options)
    serve.run(app, name="cism", route_prefix="/")

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    # SIGTERM too shuts Serve and Ray down cleanly (set after ray.init, which installs its own)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    print(f"cism: serving {model_name} on Ray Serve ({replicas} replicas) at http://{host}:{port}/  "
          "(Ctrl-C stops)", file=out, flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    print("cism: server stopped", file=out, flush=True)
    return 0
