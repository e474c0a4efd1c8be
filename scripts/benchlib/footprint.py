"""Code footprint of one request, from a callgrind dump made with --dump-instr=yes.

Counts the 64-byte lines of machine code that hold an instruction executed at least once per two requests
(REQUESTS / 2 times in the counted window): the code a request runs through, whose size decides how much of it
must be fetched again when other processes (the load generator, the origin) ran on the core in between. This
machine's perf counts neither cycles nor cache misses, so this count is how a change's effect on that footprint
is seen. Usage: python3 scripts/benchlib/footprint.py DUMP REQUESTS [--functions N]
(scripts/instructions --footprint runs it).
"""

import collections
import re
import sys

LINE = 64


def executed(path):
    """(object, function, address) -> times executed, for every instruction in the dump."""
    objects, functions = {}, {}
    obj = fn = None
    address = 0
    counts = collections.Counter()
    after_call = False
    name = re.compile(r"(c?)(ob|fn)=\((\d+)\)(?: (.*))?")
    with open(path, encoding="utf-8", errors="replace") as dump:
        for line in dump:
            match = name.match(line)
            if match:
                table = objects if match.group(2) == "ob" else functions
                if match.group(4) is not None:
                    table[match.group(3)] = match.group(4).strip()
                if not match.group(1):
                    if match.group(2) == "ob":
                        obj = table[match.group(3)]
                    else:
                        fn = table[match.group(3)]
                continue
            if line.startswith("calls="):
                after_call = True  # the next line is the call's inclusive cost, not the instruction's own
                continue
            if not line or line[0] not in "0123456789+-*":
                continue
            fields = line.split()
            position = fields[0]
            if position.startswith("0x"):
                address = int(position, 16)
            elif position[0] in "+-":
                address += int(position)
            elif position != "*":
                continue
            if after_call:
                after_call = False
                continue
            if len(fields) >= 3:
                counts[(obj, fn, address)] += int(fields[2])
    return counts


def main():
    path, requests = sys.argv[1], int(sys.argv[2])
    show = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--functions" else 0
    counts = executed(path)
    lines_by_object = collections.defaultdict(set)
    lines_by_function = collections.defaultdict(set)
    for (obj, fn, address), count in counts.items():
        if count * 2 >= requests:
            lines_by_object[obj.rsplit("/", 1)[-1]].add(address // LINE)
            lines_by_function[fn].add(address // LINE)
    total = sum(len(lines) for lines in lines_by_object.values())
    parts = ", ".join(
        f"{name} {len(lines) * LINE // 1024}"
        for name, lines in sorted(lines_by_object.items(), key=lambda item: -len(item[1]))
        if len(lines) * LINE >= 1024
    )
    by_object = f"; by object, KiB: {parts}" if parts else ""
    print(f"{total} lines of code per request ({total * LINE // 1024} KiB{by_object})")
    for fn, lines in sorted(lines_by_function.items(), key=lambda item: -len(item[1]))[:show]:
        print(f"    {len(lines):5d}  {fn[:150]}")


if __name__ == "__main__":
    main()
