"""Wrap key functions with wall timers; print totals at exit."""
import time, atexit, collections, functools, importlib
T = collections.defaultdict(float); N = collections.Counter()
def wrap(modname, attr_path):
    mod = importlib.import_module(modname)
    *owners, name = attr_path.split(".")
    obj = mod
    for o in owners: obj = getattr(obj, o)
    orig = getattr(obj, name)
    key = attr_path
    @functools.wraps(orig)
    def timed(*a, **k):
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally: T[key] += time.perf_counter() - t; N[key] += 1
    setattr(obj, name, timed)
def report():
    for k in sorted(T, key=lambda k: -T[k]):
        print(f"TIMING {k:55s} {T[k]:8.2f}s n={N[k]:6d} {T[k]/max(N[k],1)*1e3:7.3f} ms")
atexit.register(report)
def wrap_keyed(modname, attr_path, keyfn):
    mod = importlib.import_module(modname)
    *owners, name = attr_path.split(".")
    obj = mod
    for o in owners: obj = getattr(obj, o)
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def timed(*a, **k):
        key = attr_path + keyfn(*a, **k)
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally: T[key] += time.perf_counter() - t; N[key] += 1
    setattr(obj, name, timed)
