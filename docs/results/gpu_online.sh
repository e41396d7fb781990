#!/bin/bash
# Issue 16 on a lent GPU (the `device` tool): online EAGLE-3 training of the default model's heads, staged for two
# back-to-back calls, because one call carries at most 64 MiB and the GGUF is 98 MB.
#
#   here:        bash docs/results/gpu_online.sh stage      # .gpu/{a,b,common}, heads moved to /tmp/heads_bak
#   call 1:      run(command="bash .gpu/common/gpu_online.sh device", carry=[".gpu/common", ".gpu/a"], timeout_s=120)
#   call 2 (at once, while the machine is warm; MINUTES leaves ~1.5 min of the 10-minute call for transfers):
#                run(command="MINUTES=8 bash .gpu/common/gpu_online.sh device", carry=[".gpu/common", ".gpu/b"],
#                    timeout_s=590)
#   here:        bash docs/results/gpu_online.sh restore    # the heads back into the tree (git checkout)
#   then:        python -m specdec.train.online pack <files_at>/heads-final.safetensors -m MODEL -o H.safetensors
#                python docs/results/eagle3_curve.py --heads <packed checkpoints...>
# Each call keeps the half it carries in /root/parts; the call that finds both halves trains (either order works).
set -euo pipefail
case "${1:-}" in
stage)
    G=$(.venv/bin/python -c "from specdec.loader import default_model_path; print(default_model_path())")
    grep -qs '^/.gpu/' .git/info/exclude || { mkdir -p .git/info; echo '/.gpu/' >> .git/info/exclude; }
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/common
    split -n 2 -d "$G" .gpu/part && mv .gpu/part00 .gpu/a/ && mv .gpu/part01 .gpu/b/
    sha256sum "$G" | cut -d' ' -f1 > .gpu/common/sha256
    cp ../shared/data/train_prompts_seed_tasks.jsonl ../shared/data/spec_bench/question.jsonl "$0" .gpu/common/
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .gpu/common gguf==0.19.0
    mkdir -p /tmp/heads_bak && mv specdec/heads/*.safetensors /tmp/heads_bak/  # 24 MB the calls need not carry
    du -sh .gpu/*
    ;;
restore)
    git checkout specdec/heads
    ;;
device)
    mkdir -p /root/parts
    cp .gpu/a/part* .gpu/b/part* /root/parts/ 2>/dev/null || true
    nvidia-smi -L || true
    if [ ! -f /root/parts/part00 ] || [ ! -f /root/parts/part01 ]; then echo "WAITING-FOR-OTHER-PART"; exit 0; fi
    cat /root/parts/part00 /root/parts/part01 > /root/model.gguf
    echo "$(cat .gpu/common/sha256)  /root/model.gguf" | sha256sum -c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/common/gguf-*.whl
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    python3 -m specdec.train.online train /root/model.gguf -o "$OUT" --device cuda --minutes "${MINUTES:-8}" \
        --seed-prompts .gpu/common/train_prompts_seed_tasks.jsonl --spec-bench .gpu/common/question.jsonl \
        --prompt-batch 4096 --gen-batch 4096 --checkpoints 1e6,3e6,1e7,3e7 2>&1 | grep --line-buffered -v 'it/s\]'
    ls -la "$OUT"
    ;;
*)
    echo "usage: $0 stage | device | restore" >&2
    exit 2
    ;;
esac
