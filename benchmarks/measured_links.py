"""The measured cluster's outer bandwidth against the shaped link rate (issue 29).

    sudo python benchmarks/measured_links.py [--rates 2.5,5,10] [--out out/measured_links]

Two hosts of two ranks each (network namespaces, tests/netns_hosts.py), the link shaped with tc
tbf at each rate; `tests/cluster_worker.py` measures the cluster (`cluster="auto"`) and the table
shows the outer level's bandwidth against the rate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from netns_hosts import TwoHosts  # noqa: E402

from pdcompile.core.cluster import Cluster  # noqa: E402


def measure(rate_gbit: float, out: Path, timeout_s: float = 200.0) -> float:
    """The measured outer bandwidth (bytes/s) with the link shaped to `rate_gbit`."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    with TwoHosts() as hosts:
        hosts.shape(rate_gbit * 1e9 / 8)
        worker = str(HERE.parent / "tests" / "cluster_worker.py")
        for h in "ab":
            hosts.torchrun(h, worker, ["--out", str(out)], log=out / f"{h}.log")
        deadline = time.monotonic() + timeout_s
        while len(list(out.glob("cluster-rank*.json"))) < 4:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no measured cluster within {timeout_s} s: see {out}")
            time.sleep(0.5)
        cluster = Cluster.from_json(next(out.glob("cluster-rank*.json")).read_text())
    return cluster.levels[-1].bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2.5,5,10", help="Gbit/s, comma-separated")
    parser.add_argument("--out", default="out/measured_links")
    args = parser.parse_args()
    table = Table(title="measured outer bandwidth against the shaped rate")
    for column in ("shaped", "measured", "measured / shaped"):
        table.add_column(column, justify="right")
    for rate in (float(r) for r in args.rates.split(",")):
        measured = measure(rate, Path(args.out) / f"{rate:g}") * 8 / 1e9
        table.add_row(f"{rate:g} Gbit/s", f"{measured:.2f} Gbit/s", f"{measured / rate:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
