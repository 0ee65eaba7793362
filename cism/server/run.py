"""`cism serve`: load a model, start its engine, serve the app with uvicorn
until SIGINT or SIGTERM (then finish or cancel what is in flight)."""
import signal
import socket
import sys


SWITCH_INTERVAL = 0.0005


def need_serving_deps():
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"cism serve needs the serve extra: pip install \"cism[serve]\" ({e.name} is missing)") from None


def engine_options(args):
    return dict(max_seqs=args.max_seqs, max_queue=args.max_queue, max_step_tokens=args.max_step_tokens,
                kv_blocks=args.kv_blocks, prefix_caching=not args.no_prefix_cache)


def bind(host, port):
    """A listening socket (port 0: any free port), so the URL is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(model, *, model_name, host="127.0.0.1", port=8080, api_key=None, engine_kwargs=None,
          max_body_bytes=None, graceful_seconds=10, log_level="warning", out=sys.stderr):
    """Serve `model` until SIGINT/SIGTERM. Prints the URL once it accepts connections."""
    need_serving_deps()
    import uvicorn

    from cism.engine import Engine
    from cism.server.app import DEFAULT_MAX_BODY, create_app

    # the engine thread needs the GIL for a moment after every forward; the
    # event loop's thread holding it for the default 5 ms would stall the
    # step (a 16-stream step takes ~40 ms of which most is nogil compute)
    sys.setswitchinterval(SWITCH_INTERVAL)
    engine = Engine(model, **(engine_kwargs or {}))
    app = create_app(engine, model_name=model_name, api_key=api_key,
                     max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY)
    sock = bind(host, port)
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{sock.getsockname()[1]}"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(f"cism: serving {model_name} at {url}/  (OpenAI API at {url}/v1; "
                      "Ctrl-C stops)", file=out, flush=True)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_seconds,
                            access_log=False)
    server = Server(config)
    # uvicorn takes SIGINT/SIGTERM while it serves (stop accepting, finish the
    # requests in flight), then hands the signal to the handler it found:
    # ours ends the process cleanly instead of the default's abrupt exit.
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        engine.shutdown(drain=False, timeout=30)
        sock.close()
    print("cism: server stopped", file=out, flush=True)
    return 0


class _Stopped(Exception):
    pass


def _stop(signum, frame):
    raise _Stopped()
