# Offline setup on a lent GPU machine (sourced by tools/gpu/run.sh from the repo root): the
# bundle's wheels into /tmp/site, the repo's packages linked in as `omnifabric`, an import
# smoke test. Needs .whl, .gpu and proto/omni carried (tools/gpu/bundle.sh).
_omni_install() {
    local repo=$PWD site=/tmp/site py=python3
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$repo"/.whl/*.whl || { echo "install.sh: pip failed" >&2; return 1; }
    [ -f "$repo/proto/omni/realtime/v1/STUBS_STAMP" ] || { echo "install.sh: no stubs (carry proto/omni)" >&2; return 1; }
    mkdir -p "$site/omnifabric"; rm -f "$site/omnifabric/__init__.py"
    local pair
    for pair in omni:proto/omni edge:edge worker:worker scheduler:scheduler tools:tools common:common; do
        ln -sfn "$repo/${pair#*:}" "$site/omnifabric/${pair%%:*}" || return 1
    done
    export PYTHONPATH="$site"
    "$py" -c "import transformers, librosa, soundfile, stepaudio2, s3tokenizer, hyperpyyaml; import omnifabric.tools.gpu_sessions, omnifabric.worker.engines.minicpmo.engine, omnifabric.worker.engines.minicpmo.vocoder; print('transformers', transformers.__version__)" \
        || { echo "install.sh: import smoke test failed" >&2; return 1; }
}
_omni_install
