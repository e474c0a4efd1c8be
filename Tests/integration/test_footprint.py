"""scripts/benchlib/footprint.py: the code a request runs through, read from a callgrind dump.

The dump below is written as callgrind 3.19 writes one with --dump-instr=yes (names compressed to numbers after
their first use, addresses absolute or relative to the previous line, a call's inclusive cost on the line after
`calls=`), so that the count is checked against the format, not against the parser's own idea of it.
"""

import subprocess
import sys
from pathlib import Path

FOOTPRINT = Path(__file__).resolve().parents[2] / "scripts" / "benchlib" / "footprint.py"

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
positions: instr line
events: Ir
summary: 99999

ob=(1) /tmp/x/proxyctl
fl=(1) ???
fn=(1) hot
0x1000 0 4000
+4 0 4000
+60 0 2000
calls=2000 0x5000 0
0x1044 0 9999999
+2 0 1999
fn=(2) cold
0x2000 0 10
ob=(2) /usr/lib/libc.so.6
fl=(2) ???
fn=(3) memcpy
0x5000 0 2000
cob=(1)
cfn=(1)
calls=1 0x1000 0
* 0 7
-3 0 2000
"""


def run(tmp_path, *arguments):
    dump = tmp_path / "callgrind.out"
    dump.write_text(DUMP)
    result = subprocess.run(
        [sys.executable, str(FOOTPRINT), str(dump), *arguments], capture_output=True, text=True, check=True
    )
    return result.stdout


def test_lines_executed_at_least_once_per_two_requests_are_counted_by_object(tmp_path):
    # 4,000 requests: hot's 0x1000 and 0x1004 (one line) and 0x1040 (2,000 times: half the requests, counted)
    # are two lines; 0x1046 ran 1,999 times (not counted; the 9,999,999 before it is the call's inclusive cost,
    # not the call instruction's); cold ran 10 times. libc: 0x5000 and 0x4ffd are lines 0x140 and 0x13f.
    out = run(tmp_path, "4000")
    assert out.startswith("4 lines of code per request (0 KiB)"), out


def test_the_functions_are_listed_by_their_lines(tmp_path):
    out = run(tmp_path, "4000", "--functions", "3").splitlines()
    assert [line.split(None, 1) for line in out[1:]] == [["2", "hot"], ["2", "memcpy"]], out


def test_a_higher_count_of_requests_leaves_out_what_ran_for_half_of_them(tmp_path):
    # 8,000 requests: only what ran 4,000 times or more (hot's first line).
    assert run(tmp_path, "8000").startswith("1 lines of code per request"), run(tmp_path, "8000")
