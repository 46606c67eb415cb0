"""`make loadtest`: start a local kvserve, run locust headless against it, stop the server.

Leaves locust's CSV files and HTML report in --results.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from launch import launched_server


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--spawn-rate", type=float, default=4)
    ap.add_argument("--duration", default="60s")
    ap.add_argument("--results", default="results")
    ap.add_argument("--serve-args", default="", help="extra arguments for kvserve serve")
    args = ap.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with launched_server(args.model, args.serve_args.split()) as url:
        cmd = [sys.executable, "-m", "locust", "-f", str(Path(__file__).with_name("locustfile.py")), "--host", url,
               "--headless", "-u", str(args.users), "-r", str(args.spawn_rate), "-t", args.duration,
               "--csv", str(results / "locust"), "--html", str(results / "locust.html"), "--only-summary"]
        code = subprocess.run(cmd).returncode
    print(f"locust reports: {results}/locust_stats.csv, {results}/locust.html", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
