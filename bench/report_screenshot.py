"""Render the Snakemake HTML report headless with Debian's chromium, as a reader would see it.

    python bench/report_screenshot.py [--report results/report.html] [--out results/bench/report]

Writes one PNG per view: the landing page, and the report's claims, recommendation, differences,
power, frontier, correlation figure and pipeline-cost pages opened the way a click would open
them (a copy of the report with a few lines of script appended; the report itself is not
changed). Prints the seconds each view took. Chromium runs with a fresh profile, no network
services and no sandbox (root in a VM).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]
# view name -> file name of the registered result to open (None: the landing page)
VIEWS = {
    "landing": None,
    "overview": "overview.html",
    "claims": "claims.html",
    "recommendations": "recommendations.html",
    "differences": "differences.html",
    "power": "power.html",
    "frontier": "frontier.png",
    "correlation": "correlation.png",
    "pipeline_cost": "pipeline_cost.html",
}
OPEN = """
<script>
window.addEventListener("load", () => setTimeout(() => {{
  const path = Object.keys(results).find(p => p.endsWith({name}));
  const entry = results[path];
  app.showCategory("Report");  // the menu, then (after React re-renders) the page itself
  setTimeout(() => app.setView({{content: entry.mime_type === "text/html" ? "html" : "img",
                                contentPath: entry.data_uri, resultPath: path}}), 300);
}}, 300));
</script>
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    sys.exit("chromium not found: `make bench-report` installs Debian's package (apt-get install -y chromium)")


def screenshot(browser: str, page: Path, out: Path, size: str, timeout: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kvbench-chromium-") as profile:
        start = time.monotonic()
        subprocess.run(
            [
                browser,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                "--virtual-time-budget=4000",
                f"--screenshot={out}",
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=Path("results/report.html"))
    parser.add_argument("--out", type=Path, default=Path("results/bench/report"), help="folder for the PNGs")
    parser.add_argument("--size", default="1600,1000", help="window width,height")
    parser.add_argument("--timeout", type=int, default=120)
    args = parser.parse_args()
    if not args.report.is_file():
        sys.exit(f"{args.report} not found: run `make report` first")
    browser = chromium()
    args.out.mkdir(parents=True, exist_ok=True)
    html = args.report.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="kvbench-report-") as tmp:
        for view, name in VIEWS.items():
            page = args.report
            if name is not None:
                page = Path(tmp) / f"{view}.html"
                head, tag, tail = html.rpartition("</body>")  # the last one: the bundled scripts quote the tag
                page.write_text(head + OPEN.format(name=json.dumps(name)) + tag + tail, encoding="utf-8")
            target = args.out / f"{view}.png"
            seconds = screenshot(browser, page, target, args.size, args.timeout)
            print(f"{view:<16} {target}  ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
