#!/usr/bin/env bash
# Here, without a GPU: build mempool-rmm's conformance test binary at each of several versions of the code,
# for scripts/bisect-run.sh on the GPU machine (carry .bisect.tgz, `tar xzf .bisect.tgz` there first).
#
#   scripts/bisect-pack.sh NAME=REV[:R1,R2,...] ...
#
# Each NAME gets .bisect/NAME/conformance, built from REV with the commits R1, R2, ... reverted on top, in
# that order (to bring back work that was reverted, name the revert commits). The builds share one target
# directory (target/bisect) and use detached worktrees under $TMPDIR that are removed afterwards.
# Example (issue 33's bisect, on 6458289: the reverts of the narrower waits, of the per-thread stream
# ids and of the service resource's fences, each brought back alone):
#   scripts/bisect-pack.sh base=6458289 waits=6458289:5005dfd stream=6458289:70dc3bb,f8ecd48 \
#     service=6458289:c3b9db5,0a79e89,36ba238
set -euo pipefail
[ $# -gt 0 ] || { sed -n '2,12p' "$0"; exit 2; }
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.bisect/' "$exclude" 2>/dev/null || echo '/.bisect/' >> "$exclude"
grep -qxF '/.bisect.tgz' "$exclude" 2>/dev/null || echo '/.bisect.tgz' >> "$exclude"
rm -rf .bisect && mkdir -p .bisect
export CARGO_TARGET_DIR="$root/target/bisect" CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo
for spec in "$@"; do
  name=${spec%%=*} rest=${spec#*=}
  rev=${rest%%:*} reverts=""
  [ "$rest" != "$rev" ] && reverts=${rest#*:}
  case "$name" in ''|*[!A-Za-z0-9_.-]*) echo "bisect-pack: a NAME is letters, digits, '.', '_' and '-': $name" >&2; exit 2 ;; esac
  wt=$(mktemp -d "${TMPDIR:-/tmp}/bisect-$name.XXXX")
  git worktree add --detach "$wt" "$rev" > /dev/null
  for r in ${reverts//,/ }; do
    git -C "$wt" -c user.name=bisect -c user.email=bisect@localhost revert --no-edit "$r" > /dev/null
  done
  exe=$(cd "$wt" && cargo test -p mempool-rmm --features gpu --release --test conformance --no-run \
          --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "conformance":
        print(m["executable"])')
  [ -n "$exe" ] || { echo "bisect-pack: $name: the build failed (run it in $wt to see why)" >&2; exit 1; }
  mkdir -p ".bisect/$name"
  cp "$exe" ".bisect/$name/conformance"
  echo "$name: $(git -C "$wt" rev-parse --short HEAD) ($rev${reverts:+, reverted $reverts})" | tee ".bisect/$name/REV"
  git worktree remove --force "$wt"
done
tar czf .bisect.tgz .bisect
echo "bisect-pack: .bisect.tgz is $(du -m .bisect.tgz | cut -f1) MiB; on the GPU: tar xzf .bisect.tgz && bash scripts/bisect-run.sh ROUNDS LIMIT"
