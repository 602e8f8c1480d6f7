#!/usr/bin/env python3
"""Draws every Grafana dashboard of the chart from a real Prometheus into PNGs (docs/dashboards/).

Each panel is placed where its gridPos puts it in Grafana and runs its own PromQL (with the
dashboard variables set to "All", a fixed rate window, and the CRD's default hit-rate target).
There is no Grafana here: this is how the dashboards were looked at. The usual source of data is
the chart tests' live stack (a loaded server, the operator, Prometheus scraping both):

    MAMBASERVE_LIVE_LOAD_SECONDS=180 MAMBASERVE_PLOT_DASHBOARDS=docs/dashboards \\
        .venv/bin/python -m pytest -q tests/charts/test_monitoring.py -k panel_query

or point it at any Prometheus: --prometheus http://127.0.0.1:9090 --start <unix> --end <unix>.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import time

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "charts" / "mambaserve" / "dashboards"

UNITS = {"percentunit": ("%", 100.0), "s": ("s", 1.0), "reqps": ("req/s", 1.0), "ops": ("/s", 1.0),
         "short": ("", 1.0)}


def substitute(expr: str, rate_window: str) -> str:
    for var, value in {"$namespace": ".*", "$session": ".*", "$__rate_interval": rate_window,
                       "$target_hit_rate": "0.5", "$target_capacity_miss_ratio": "0.1"}.items():
        expr = expr.replace(var, value)
    return expr


def legend(fmt: str, labels: dict[str, str]) -> str:
    if fmt in ("", "__auto"):
        return ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step},
                  timeout=60)
    body = r.json()
    if body.get("status") != "success":
        raise ValueError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def plot_dashboard(path: pathlib.Path, url: str, start: float, end: float, step: float, rate_window: str,
                   out: pathlib.Path) -> pathlib.Path:
    dash = json.loads(path.read_text())
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    unit_h = 0.42  # inches per Grafana grid row
    fig = plt.figure(figsize=(20, rows * unit_h + 0.9))
    top = 1 - 0.9 / (rows * unit_h + 0.9)
    fig.suptitle(f"{dash['title']}  ({datetime.datetime.fromtimestamp(start):%H:%M:%S}-"
                 f"{datetime.datetime.fromtimestamp(end):%H:%M:%S}, live Prometheus)", fontsize=14, x=0.01,
                 ha="left")
    for panel in dash["panels"]:
        g = panel["gridPos"]
        # Room for the y tick labels on the left, and for the x tick labels and the next title below.
        row = top / rows
        left, width = g["x"] / 24 + 0.035, g["w"] / 24 - 0.045
        bottom = top - (g["y"] + g["h"]) * row + 1.2 * row
        height = g["h"] * row - 2.2 * row
        ax = fig.add_axes((left, bottom, width, height))
        unit, scale = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", "short"), ("", 1.0))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        series = []
        for target in panel["targets"]:
            for s in query_range(url, substitute(target["expr"], rate_window), start, end, step):
                points = [(float(t), float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    series.append((legend(target["legendFormat"], s["metric"]), points))
        if panel["type"] == "stat":
            ax.axis("off")
            if series and panel["options"].get("textMode") == "name":  # an info metric: its labels are the data
                ax.text(0.5, 0.4, "\n".join(name for name, _ in series), ha="center", va="center", fontsize=12,
                        transform=ax.transAxes)
            elif series:
                last = series[0][1][-1][1] * scale
                decimals = panel["fieldConfig"]["defaults"].get("decimals", 2 if abs(last) < 100 else 0)
                ax.text(0.5, 0.4, f"{last:.{decimals}f} {unit}".strip(), ha="center", va="center", fontsize=22,
                        transform=ax.transAxes, color=_stat_color(panel, series[0][1][-1][1]))
            else:
                ax.text(0.5, 0.4, "no data", ha="center", va="center", color="red", transform=ax.transAxes)
            continue
        for name, points in series:
            ax.plot([datetime.datetime.fromtimestamp(t) for t, _ in points], [v * scale for _, v in points],
                    label=name, linewidth=1.2)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", color="red", transform=ax.transAxes)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.tick_params(labelsize=8)
        ax.set_ylabel(unit, fontsize=8)
        defaults = panel["fieldConfig"]["defaults"]
        if defaults.get("min") is not None:
            ax.set_ylim(bottom=defaults["min"] * scale)
        if defaults.get("max") is not None:
            ax.set_ylim(top=defaults["max"] * scale * 1.02)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7, loc="upper left", ncol=min(len(series), 3), framealpha=0.6)
    target = out / f"{path.stem}.png"
    fig.savefig(target, dpi=80)
    plt.close(fig)
    return target


def _stat_color(panel: dict, value: float) -> str:
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    color = steps[0]["color"]
    for step in steps[1:]:
        if value >= step["value"]:
            color = step["color"]
    return {"green": "tab:green", "orange": "tab:orange", "red": "tab:red"}.get(color, "black")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--start", type=float, default=None, help="unix time (default: 15 minutes ago)")
    parser.add_argument("--end", type=float, default=None, help="unix time (default: now)")
    parser.add_argument("--rate-window", default="15s", help="what $__rate_interval becomes")
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboards"))
    args = parser.parse_args()
    end = args.end or time.time()
    start = args.start or end - 900
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    step = max(1.0, (end - start) / 300)
    for path in sorted(DASHBOARDS.glob("*.json")):
        print(plot_dashboard(path, args.prometheus, start, end, step, args.rate_window, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
