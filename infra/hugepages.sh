#!/usr/bin/env bash
# Reserves 2 MiB huge pages for the KV pool's store segments (moorage-hugepages.service runs it before
# any store starts; run it by hand as root on hosts without systemd).
#
#   hugepages.sh reserve   raise vm.nr_hugepages so MOORAGE_HUGEPAGES_BYTES fit (the sum of the
#                          segment_bytes of the stores on this host), remembering the old value
#   hugepages.sh release   put the old value back
#   hugepages.sh status    what is reserved and free now
#
# A store with `hugepages = "auto"` uses them when enough are free and falls back to ordinary pages
# (with a warning) otherwise; `hugepages = "on"` refuses to start without them.
set -euo pipefail
PAGE=$((2 * 1024 * 1024))
SYSCTL=${MOORAGE_HUGEPAGES_SYSCTL:-/proc/sys/vm/nr_hugepages}
SAVED=${MOORAGE_HUGEPAGES_SAVED:-/run/moorage-hugepages.prev}
want_bytes=${MOORAGE_HUGEPAGES_BYTES:-0}

pages_for() { echo $(( ($1 + PAGE - 1) / PAGE )); }

case "${1:-status}" in
  reserve)
    if [ "$want_bytes" -le 0 ]; then
      echo "hugepages: MOORAGE_HUGEPAGES_BYTES is unset or 0: nothing to reserve"; exit 0
    fi
    current=$(cat "$SYSCTL")
    [ -f "$SAVED" ] || echo "$current" > "$SAVED"
    need=$(( $(cat "$SAVED") + $(pages_for "$want_bytes") ))
    if [ "$current" -lt "$need" ]; then
      echo "$need" > "$SYSCTL"
    fi
    got=$(cat "$SYSCTL")
    if [ "$got" -lt "$need" ]; then
      echo "hugepages: asked for $need pages of 2 MiB, the kernel granted $got (memory too fragmented:" \
           "reserve at boot with the kernel argument hugepages=$need)" >&2
      exit 1
    fi
    echo "hugepages: $got pages of 2 MiB reserved ($(( got * 2 )) MiB)"
    ;;
  release)
    if [ -f "$SAVED" ]; then
      cat "$SAVED" > "$SYSCTL"
      rm -f "$SAVED"
    fi
    echo "hugepages: $(cat "$SYSCTL") pages of 2 MiB reserved"
    ;;
  status)
    grep -E '^HugePages_(Total|Free|Rsvd)|^Hugepagesize' /proc/meminfo
    ;;
  *)
    echo "usage: $0 reserve|release|status" >&2; exit 2
    ;;
esac
