"""Summarizes the stamps that the meeting-stamps patch prints (stderr of a DFLASH_PROBE=2 bench-step run):
probe_h200x2_qwen3-8b-shape_tp2_meeting_timeline.txt. Usage: python3 THIS_FILE probe.txt"""
import re
import statistics as st
import sys

rows = {}
for line in open(sys.argv[1]):
    m = re.match(r'probe dev (\d) slot (\d+) push_end (\d+) wait_done (\d+)\.\.(\d+) words_in (\d+) end (\d+)', line)
    if m:
        d, slot, *t = map(int, m.groups())
        rows.setdefault(slot, {})[d] = t  # push_end, wait_done first, wait_done last, words_in, end
both = [r for _, r in sorted(rows.items()) if 0 in r and 1 in r]


def q(v):
    v = sorted(v)
    n = len(v)
    return f"median {st.median(v) / 1000:.2f} us, p10 {v[n // 10] / 1000:.2f}, p90 {v[9 * n // 10] / 1000:.2f}"


print(f"# {len(both)} exchanges (the last 1024 pushed sums of 16 rows: about 12 DFlash steps, both GPUs)")
for d in (0, 1):
    print(f"## GPU {d}")
    print("  own product's last push -> the RMSNorm's first block past its wait:", q([r[d][1] - r[d][0] for r in both]))
    print("  the RMSNorm's last block past its wait -> all its blocks have the peer's words:", q([r[d][3] - r[d][2] for r in both]))
    print("  words in -> the RMSNorm's end:", q([r[d][4] - r[d][3] for r in both]))
print("## across the GPUs (their globaltimers differ by a fixed offset of about 112 us here, so only the spread means something)")
print("  GPU 0's last push - GPU 1's last push:", q([r[0][0] - r[1][0] for r in both]))
s = [(r[0][3] - r[0][0]) + (r[1][3] - r[1][0]) for r in both]
print("## per exchange, the two GPUs' (own last push -> peer's words in) added: 2 x the trip from a last push to its words in on the other GPU, whatever the skew")
print("  ", q(s), " -> the trip: about", f"{st.median(s) / 2000:.2f} us")
print("## their difference (2 x the skew between the GPUs' last pushes):", q([(r[0][3] - r[0][0]) - (r[1][3] - r[1][0]) for r in both]))
