# Peak RSS and wall time of `specdec generate`, two checkouts alternated (docs/results/rss-heads-1206.txt):
#   BEFORE=/path/to/old/checkout AFTER=. PYTHON=.venv/bin/python bash docs/results/rss_ab.sh
before=$(realpath "${BEFORE:?a checkout of the earlier commit}")
after=$(realpath "${AFTER:-.}")
py=${PYTHON:-.venv/bin/python}
python=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")  # absolute, the venv link kept
cd /tmp  # so that neither checkout is on the path by the working directory
for r in 1 2 3; do
  for v in before after; do
    if [ $v = before ]; then pp=$before; else pp=$after; fi
    for s in auto none; do
      PYTHONPATH=$pp /usr/bin/time -f "$v --spec $s: %e s wall, peak RSS %M KB" "$python" -m specdec generate \
        -p "The capital of France is" -n 64 --spec $s 2>&1 | tail -1
    done
  done
done
