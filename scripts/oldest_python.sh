# Sourced, from the repository root, by scripts/setup_oldest.sh and .ci/run: the oldest Python
# that pyproject.toml's requires-python admits, so that raising it moves both.

# Prints that version, "3.N", read from the line requires-python = ">=3.N".
oldest_python_version() {
    local version
    version=$(sed -n 's/^requires-python = ">=\(3\.[0-9]*\)"$/\1/p' pyproject.toml)
    if [[ -z "$version" ]]; then
        echo 'oldest_python.sh: expected a line requires-python = ">=3.N" in pyproject.toml' >&2
        return 1
    fi
    echo "$version"
}

# Prints an interpreter that runs as that version: GRADREF_OLDEST_PYTHON, python3.N on the
# PATH, or one of pyenv's versions. pyenv's shims are on PATH for every version but run only
# the selected ones, so its versions directory is searched as well.
oldest_python() {
    local version candidate
    version=$(oldest_python_version) || return 1
    local candidates=("${GRADREF_OLDEST_PYTHON:-}" "$(command -v "python$version" || true)")
    if command -v pyenv >/dev/null; then
        candidates+=($(ls -d "$(pyenv root)"/versions/"$version".*/bin/python 2>/dev/null | sort -rV))
    fi
    for candidate in "${candidates[@]}"; do
        if [[ -n "$candidate" ]] && [[ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$version" ]]; then
            echo "$candidate"
            return 0
        fi
    done
    echo "oldest_python.sh: no Python $version found (tried GRADREF_OLDEST_PYTHON, python$version" \
        "on PATH and pyenv's versions); install it, e.g. 'pyenv install $version', or set" \
        "GRADREF_OLDEST_PYTHON=/path/to/python$version" >&2
    return 1
}
