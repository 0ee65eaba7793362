"""/metrics: the server's and the engine's counters in Prometheus' text format."""
import threading


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.requests = {}          # (route, outcome) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.http_responses = {}    # status -> count
        self.in_flight = 0

    def started(self, route, prompt_tokens):
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.requests[(route, "started")] = self.requests.get((route, "started"), 0) + 1
            self.in_flight += 1

    def finished(self, outcome, completion_tokens):
        with self.lock:
            self.completion_tokens += completion_tokens
            self.requests[("all", outcome)] = self.requests.get(("all", outcome), 0) + 1
            self.in_flight = max(0, self.in_flight - 1)

    def http(self, path, status):
        with self.lock:
            self.http_responses[status] = self.http_responses.get(status, 0) + 1

    def render(self):
        st = self.engine.stats()
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP cism_{name} {help_}")
            lines.append(f"# TYPE cism_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"cism_{name}{{{lab}}} {value}" if lab else f"cism_{name} {value}")

        with self.lock:
            reqs = dict(self.requests)
            http = dict(self.http_responses)
            prompt, completion, inflight = self.prompt_tokens, self.completion_tokens, self.in_flight
        metric("requests_total", "counter", "Generation requests by route (started) and by outcome.",
               [({"route": r, "outcome": o}, v) for (r, o), v in sorted(reqs.items())])
        metric("http_responses_total", "counter", "HTTP responses by status code.",
               [({"code": str(c)}, v) for c, v in sorted(http.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [({}, prompt)])
        metric("completion_tokens_total", "counter", "Tokens generated for answered requests.",
               [({}, completion)])
        metric("requests_in_flight", "gauge", "HTTP generation requests being answered.", [({}, inflight)])
        metric("engine_finished_total", "counter", "Engine requests by finish reason.",
               [({"reason": k}, st.get(f"finished_{k}", 0)) for k in ("stop", "length", "cancelled", "error")])
        metric("engine_generated_tokens_total", "counter", "Tokens the engine chose.",
               [({}, st.get("generated_tokens", 0))])
        metric("engine_steps_total", "counter", "Engine steps (one forward each).", [({}, st.get("steps", 0))])
        metric("queue_depth", "gauge", "Requests waiting for admission.", [({}, st.get("queue_depth", 0))])
        metric("running_sequences", "gauge", "Requests admitted and running.", [({}, st.get("running", 0))])
        metric("preemptions_total", "counter", "Requests preempted (recomputed later).",
               [({}, st.get("preemptions", 0))])
        metric("kv_blocks", "gauge", "KV blocks of 16 positions: total, used (held by requests or the cache), cached.",
               [({"state": "total"}, st.get("kv_blocks_total", 0)), ({"state": "used"}, st.get("kv_blocks_used", 0)),
                ({"state": "cached"}, st.get("cached_blocks", 0))])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / tokens looked up.",
               [({}, st.get("prefix_hit_rate", 0.0))])
        metric("prefix_cache_lookups_total", "counter", "Prefix-cache lookups by result.",
               [({"result": "hit"}, st.get("prefix_hits", 0)), ({"result": "miss"}, st.get("prefix_misses", 0))])
        metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
               [({}, st.get("prefix_hit_tokens", 0))])
        metric("spec_tokens_total", "counter", "Speculative draft tokens proposed and accepted.",
               [({"kind": "proposed"}, st.get("spec_proposed", 0)), ({"kind": "accepted"}, st.get("spec_accepted", 0))])
        for name, help_ in (("step_seconds", "Seconds per engine step (one forward)."),
                            ("ttft_seconds", "Seconds from submission to the first token.")):
            h = self.engine.histograms[name].snapshot()
            lines.append(f"# HELP cism_{name} {help_}")
            lines.append(f"# TYPE cism_{name} histogram")
            for bound, count in h["buckets"]:
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                lines.append(f'cism_{name}_bucket{{le="{le}"}} {count}')
            lines.append(f"cism_{name}_sum {h['sum']}")
            lines.append(f"cism_{name}_count {h['count']}")
        return "\n".join(lines) + "\n"
