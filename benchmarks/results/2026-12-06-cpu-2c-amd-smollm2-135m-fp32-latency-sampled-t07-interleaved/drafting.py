"""How each method drafts, from a run's results.json (summed over seeds)."""
import json, sys
from collections import defaultdict
d = json.load(open(sys.argv[1]))
acc = defaultdict(lambda: defaultdict(float))
for m in d['measurements']:
    sd = m.get('spec_decode')
    if not sd or not sd['drafts']:
        continue
    a = acc[(m['dataset'], m['method'])]
    a['steps'] += m['engine_steps']; a['drafts'] += sd['drafts']
    a['tokens'] += sd['draft_tokens']; a['accepted'] += sd['accepted']
    a['first'] += (sd['accepted_per_pos'] or [0])[0]
print('| set | method | passes with a draft | tokens a draft | first token accepted | accepted a pass |')
print('|---|---|---|---|---|---|')
for (ds, meth), a in acc.items():
    print(f"| {ds} | {meth} | {a['drafts']/a['steps']:.2f} | {a['tokens']/a['drafts']:.2f} | "
          f"{a['first']/a['drafts']:.2f} | {a['accepted']/a['steps']:.3f} |")
