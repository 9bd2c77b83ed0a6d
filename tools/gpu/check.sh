#!/usr/bin/env bash
# The GPU half of the suite on a CUDA machine without internet: installs the workspace (editable, no
# dependencies fetched) over the machine's torch and triton, with the wheels tools/gpu/fetch_wheels.py
# downloaded, then runs every test marked `gpu` and the kernels benchmark. See tools/gpu/README.md.
#
#   tools/gpu/check.sh [tests|vllm|bench|all] [pytest args...]   # from the repository root
#
# Logs go to $OUT (default /tmp/twinkle-gpu): summary.txt, gpu-tests.log/.xml, vllm-tests.log/.xml (where the
# machine has vLLM's CUDA build installed), bench-kernels.log.
set -uo pipefail

what=${1:-all}
shift || true
out=${OUT:-/tmp/twinkle-gpu}
wheels=${WHEELS:-.whl}
python=${PYTHON:-python3}
stamp=/tmp/twinkle-gpu-installed # a warm machine keeps the installation between calls
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"

step() { # step NAME SECONDS COMMAND...: runs a program under a time limit, records its status and duration
	local name=$1 limit=$2
	shift 2
	local start=$SECONDS
	timeout "$limit" "$@"
	local status=$?
	echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$summary"
	return $status
}

install() {
	[ -e "$stamp" ] && return 0
	ls "$wheels"/*.whl >/dev/null || {
		echo "no wheels in $wheels: run tools/gpu/fetch_wheels.py there first"
		return 1
	}
	"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir "$wheels"/*.whl || return 1
	local editables=()
	for package in packages/*/ kernels/; do
		[ "$package" = packages/twinkle-all/ ] || editables+=(-e "$package")
	done
	"$python" -m pip install --quiet --no-index --no-deps --no-build-isolation "${editables[@]}" || return 1
	touch "$stamp"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$summary"
start=$SECONDS
install || exit 1
echo "install: done in $((SECONDS - start)) s" | tee -a "$summary"
"$python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$summary"

if [ "$what" = tests ] || [ "$what" = all ]; then
	mapfile -t files < <(grep -rl --include='test_*.py' -e 'mark.gpu' packages kernels integration-tests | sort)
	step gpu-tests 480 "$python" -m pytest -p no:cacheprovider -m gpu -v -rA --junitxml "$out/gpu-tests.xml" \
		"${files[@]}" "$@" 2>&1 | tee "$out/gpu-tests.log"
fi
if [ "$what" = vllm ] || [ "$what" = all ]; then
	if "$python" -c "import vllm" 2>/dev/null; then # the marker `vllm` tests, against the CUDA engine
		VLLM_ENABLE_V1_MULTIPROCESSING=0 step vllm-tests 480 "$python" -m pytest -p no:cacheprovider -m vllm -v -rA \
			--junitxml "$out/vllm-tests.xml" packages/twinkle-sampler/tests packages/twinkle-server/tests/test_vllm_*.py \
			"$@" 2>&1 | tee "$out/vllm-tests.log"
	else
		echo "vllm-tests: skipped, vLLM is not installed here (its CUDA wheel cannot be carried as a wheel)" |
			tee -a "$summary"
	fi
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
	PYTHONUNBUFFERED=1 step bench-kernels 300 "$python" tools/bench/fused_kernels.py 2>&1 | tee "$out/bench-kernels.log"
fi
cat "$summary"
