#!/bin/sh
# proxyctl as a sidecar (docs/sidecar.md): the start script of the container image.
#
#   proxyctl-sidecar               make the local CA on the state volume when protected origins need one (and
#                                  reissue it when they changed), copy the CA bundle to $PROXYCTL_CA_EXPORT for
#                                  the app container, then run proxyctl serve
#   proxyctl-sidecar ARGS...       run proxyctl ARGS... instead (login --device, status, doctor, ...)
#
# The configuration comes from the environment: $PROXYCTL_CONFIG_TEXT (a whole proxy.conf) or $PROXYCTL_CONFIG
# (a mounted file), and single keys from $PROXYCTL_LISTEN, $PROXYCTL_PROXY_AUTH_FILE, $PROXYCTL_STATE_DIR,
# $PROXYCTL_ADMIN_LISTEN, $PROXYCTL_LOG_FORMAT, $PROXYCTL_LOG_LEVEL, $PROXYCTL_PROTECTED_USERS.
set -eu

proxyctl="${PROXYCTL_BIN:-proxyctl}"

if [ "$#" -gt 0 ]; then
  exec "$proxyctl" "$@"
fi

# `ca init` does nothing when the CA already covers the protected hosts, and says so when there is no
# https origin to cover (nothing to do then). A broken configuration stops the script here, every error named.
if ! output=$("$proxyctl" ca init 2>&1); then
  case "$output" in
    *"no https origin is configured"*) ;;
    *) printf '%s\n' "$output" >&2; exit 1 ;;
  esac
fi

if [ -n "${PROXYCTL_CA_EXPORT:-}" ] && "$proxyctl" ca show >/dev/null 2>&1; then
  # The system roots plus the local CA: the app container points SSL_CERT_FILE (and the like) at it.
  "$proxyctl" ca export --bundle --output "$PROXYCTL_CA_EXPORT" 2>/dev/null
  chmod 0644 "$PROXYCTL_CA_EXPORT"
  echo "proxyctl-sidecar: CA bundle for the app container in $PROXYCTL_CA_EXPORT" >&2
fi

exec "$proxyctl" serve
