import json, sys, numpy as np, collections
d = json.load(open(sys.argv[1]))
log = np.array(d["log"])
r, n, s = log[:, 0].astype(int), log[:, 1].astype(int), log[:, 2] * 1e3
k = n - r
print("steps", len(log), "with drafts", (k > 0).sum())
print(" R  | k=0: n  median q25 | k=1 | k=2 | k=3-4 | k=5+")
for R in sorted(set(r)):
    m = r == R
    if m.sum() < 10: continue
    cells = []
    for lo, hi in [(0, 0), (1, 1), (2, 2), (3, 4), (5, 99)]:
        mm = m & (k >= lo) & (k <= hi)
        cells.append(f"{mm.sum():4d} {np.median(s[mm]) if mm.any() else float('nan'):6.1f} {np.quantile(s[mm], .25) if mm.any() else float('nan'):6.1f}")
    print(f"{R:3d} | " + " | ".join(cells))
print("curve:")
for row in d["curve"][:30]:
    print(row["tokens"], row["passes"], round(row["quiet"]*1e3, 1), round(row["mean"]*1e3, 1), round((row["curve"] or 0)*1e3, 1))
