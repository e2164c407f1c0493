#!/bin/sh
# The run before the adaptive spin yielded (colo-*-no-yield.bench.json): host-colo.sh with out=/tmp/qd1c and
# guest-colo-no-yield.sh as the guest's script.
exec sed -e 's#/tmp/qd1i#/tmp/qd1c#' "$(dirname "$0")/host-colo.sh" | sh
