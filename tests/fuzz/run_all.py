"""Run every fuzz target for a while and summarise (make fuzz).

    python tests/fuzz/run_all.py --seconds 120 [--only gguf,hf_dir] [--replay]

Each target runs in its own process with libFuzzer's -max_total_time; its
corpus grows in tests/fuzz/corpus/<target> (kept between runs, not in git)
and a failing input is saved as tests/fuzz/artifacts/<target>-crash-<sha1>.
--replay instead feeds every target, once and without atheris, its committed
seeds (tests/fuzz/seeds/<target>/), its generated seeds and the saved
artifacts, each target in its own process under the address-space cap (a
quick check that fixed crashes stay fixed; tests/test_fuzz_replay.py).
"""
import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TARGETS = ["safetensors", "hf_dir", "gguf", "llama2c", "tok_json", "tok_gpt2", "tok_gguf",
           "tok_llama2c"]


def fuzz(name, seconds):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.join(HERE, f"fuzz_{name}.py"),
                           f"-max_total_time={seconds}", "-print_final_stats=1"],
                          env=env, capture_output=True, text=True)
    elapsed = time.time() - start
    log = proc.stdout + proc.stderr
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log) or \
        re.findall(r"Done (\d+) runs", log) or re.findall(r"#(\d+)\s", log)
    cov = re.findall(r"cov: (\d+)", log)
    crash = re.findall(r"Test unit written to (\S+)", log)
    with open(os.path.join(HERE, "artifacts", f"{name}.log"), "w") as f:
        f.write(log)
    return {"target": name, "runs": int(runs[-1]) if runs else 0, "seconds": round(elapsed),
            "coverage": int(cov[-1]) if cov else 0, "exit": proc.returncode,
            "crash": crash[-1] if crash else ""}


def replay(name):
    """Run one target's --replay in its own process: (exit code, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, os.path.join(HERE, f"fuzz_{name}.py"), "--replay"],
                          env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=120, help="per target")
    ap.add_argument("--only", default="", help="comma-separated target names")
    ap.add_argument("--replay", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or TARGETS
    os.makedirs(os.path.join(HERE, "artifacts"), exist_ok=True)
    if args.replay:
        failed = False
        for name in names:
            code, log = replay(name)
            failed |= code != 0
            print(log.strip() if code else log.strip().splitlines()[-1], flush=True)
        return 1 if failed else 0
    failed = False
    print(f"{'target':<12} {'runs':>9} {'seconds':>8} {'coverage':>9}  result")
    for name in names:
        r = fuzz(name, args.seconds)
        ok = r["exit"] == 0 and not r["crash"]
        failed |= not ok
        result = "ok" if ok else "FAILED " + (r["crash"] or "exit %d" % r["exit"])
        print(f"{r['target']:<12} {r['runs']:>9} {r['seconds']:>8} {r['coverage']:>9}  {result}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
