"""The JSON lines a bench/run_*.sh run left in its folder: rows(out, file) and pick(out, file, key)
(the first row whose name contains key). Lines may carry a prefix ("[rank 0] ..."), or none."""
import json, os, re

def rows(out, name):
    p = os.path.join(out, name)
    if not os.path.exists(p): return []
    found = []
    for line in open(p):
        m = re.search(r"\{.*\}", line)
        if m:
            try: found.append(json.loads(m.group(0)))
            except ValueError: pass
    return found

def pick(out, name, key):
    return next((r for r in rows(out, name) if key in r.get("name", "")), None)
