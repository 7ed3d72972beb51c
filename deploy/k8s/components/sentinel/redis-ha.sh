#!/bin/sh
# Redis with Sentinel on Kubernetes (this component): where the primary is now, and the configuration
# a Redis pod or a Sentinel starts with.
#
#   redis-ha.sh redis-conf BASE OUT   write BASE (deploy/redis/redis.conf) plus this pod's replication
#                                     settings to OUT: a replica of the current primary, or the primary
#   redis-ha.sh sentinel-conf OUT     write this Sentinel's sentinel.conf to OUT
#   redis-ha.sh primary               print "host port" of the current primary
#
# The current primary is, in this order: what another Sentinel answers to
# `SENTINEL get-master-addr-by-name` (it follows failovers; waited on while that Sentinel holds the
# primary for down or is failing it over); else the Redis pod that answers `ROLE` with `master` (all
# Sentinels gone); else the first of REDIS_NODES (a new deployment: pod 0).
#
# Environment (the pod's; the StatefulSets in this folder set it):
#   POD_NAME            this pod (downward API); its ordinal picks its own entry of REDIS_NODES or SENTINELS
#   REDIS_NODES         host:port of each Redis pod, by ordinal (ConfigMap tailcut-redis, `redis-nodes`)
#   SENTINELS           host:port of each Sentinel, by ordinal (ConfigMap tailcut-redis, `sentinels`)
#   SENTINEL_MASTER     the name the Sentinels monitor the primary under (`sentinel-master`)
#   SENTINEL_CLIENT_PASSWORD   the Sentinels' user `client`, to ask them for the primary
#   REDIS_SENTINEL_PASSWORD    Redis's user `sentinel` (Sentinel's on Redis), to ask a Redis its ROLE
#   REDIS_HA_SETTLE_S   how long to wait for the Sentinels to settle on a primary (default 60)
#   redis-conf:    REDIS_REPLICATION_PASSWORD (Redis's user `replication`: a replica's to its primary),
#                  REDIS_MIN_REPLICAS_TO_WRITE, REDIS_MIN_REPLICAS_MAX_LAG
#   sentinel-conf: SENTINEL_ADMIN_PASSWORD (the Sentinels' user `admin`, also theirs with each other),
#                  SENTINEL_QUORUM, SENTINEL_DOWN_AFTER_MS, SENTINEL_FAILOVER_TIMEOUT_MS,
#                  SENTINEL_RESOLVE_WAIT_S (how long to wait for the primary's name in DNS; default 300)
set -eu

fail() {
    echo "redis-ha: $*" >&2
    exit 1
}

need() {
    for name in "$@"; do
        eval "value=\${$name-}"
        [ -n "$value" ] || fail "$name is not set"
    done
}

# Passwords go into configuration files: the characters `openssl rand -hex 32` makes, and a few more.
safe_password() {
    eval "value=\${$1}"
    case $value in
        *[!A-Za-z0-9._~-]*) fail "$1 may only hold letters, digits and . _ ~ -" ;;
    esac
}

sha256() {
    printf '%s' "$1" | sha256sum | cut -d ' ' -f 1
}

# The LIST's entries (host:port, comma-separated) one per line.
entries() {
    printf '%s\n' "$1" | tr ',' '\n' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' -e '/^$/d'
}

# This pod's entry of LIST: the one at its ordinal (tailcut-redis-2 → the third).
own_entry() {
    ordinal=${POD_NAME##*-}
    case $ordinal in '' | *[!0-9]*) fail "POD_NAME $POD_NAME ends in no ordinal" ;; esac
    found=$(entries "$1" | sed -n "$((ordinal + 1))p")
    [ -n "$found" ] || fail "no entry $ordinal in $1"
    printf '%s\n' "$found"
}

host_of() { printf '%s\n' "${1%:*}"; }
port_of() { printf '%s\n' "${1##*:}"; }

# One command to HOST:PORT as USER (password PASSWORD): its reply, one line per element (--raw); fails
# when nothing answers within 3 s.
ask() {
    password=$1 user=$2 address=$3
    shift 3
    REDISCLI_AUTH=$password timeout 3 redis-cli --no-auth-warning --raw --user "$user" \
        -h "$(host_of "$address")" -p "$(port_of "$address")" "$@" 2>/dev/null
}

# The primary a Sentinel (other than $1) reports, and that Sentinel: "host:port sentinel-host:port".
from_sentinels() {
    own=${1-}
    for sentinel in $(entries "$SENTINELS"); do
        [ "$sentinel" = "$own" ] && continue
        reply=$(ask "$SENTINEL_CLIENT_PASSWORD" client "$sentinel" SENTINEL get-master-addr-by-name "$SENTINEL_MASTER") || continue
        host=$(printf '%s\n' "$reply" | sed -n 1p)
        port=$(printf '%s\n' "$reply" | sed -n 2p)
        # An error reply, or nil (the master is unknown there), is no address.
        case $port in '' | *[!0-9]*) continue ;; esac
        case $host in '' | *[[:space:]]*) continue ;; esac
        echo "$host:$port $sentinel"
        return 0
    done
    return 1
}

# Whether the Sentinel at $1 holds its primary for down (s_down, o_down) or is failing it over: its
# answer is about to change.
in_doubt() {
    flags=$(ask "$SENTINEL_CLIENT_PASSWORD" client "$1" SENTINEL master "$SENTINEL_MASTER" | sed -n '/^flags$/{n;p;q;}')
    case $flags in *s_down* | *o_down* | *failover*) return 0 ;; esac
    return 1
}

from_redis_pods() {
    own=${1-}
    for node in $(entries "$REDIS_NODES"); do
        [ "$node" = "$own" ] && continue
        role=$(ask "$REDIS_SENTINEL_PASSWORD" sentinel "$node" ROLE | sed -n 1p) || continue
        if [ "$role" = master ]; then
            echo "$node"
            return 0
        fi
    done
    return 1
}

# The current primary as host:port, and how it was found (on stderr). OWN_SENTINEL and OWN_REDIS are
# this pod's own entries, never asked. While the Sentinels hold the primary they name for down (it may be
# this very pod, restarting) their answer is waited on, up to REDIS_HA_SETTLE_S (default 60 s), so that a
# pod coming back during a failover follows the new primary instead of starting as a second one.
current_primary() {
    waited=0
    while answer=$(from_sentinels "${OWN_SENTINEL-}"); do
        found=${answer% *}
        sentinel=${answer#* }
        if ! in_doubt "$sentinel"; then
            echo "redis-ha: the Sentinels report the primary $found" >&2
            echo "$found"
            return 0
        fi
        if [ "$waited" -ge "${REDIS_HA_SETTLE_S:-60}" ]; then
            echo "redis-ha: the Sentinels still hold $found for down after ${waited} s; taking it" >&2
            echo "$found"
            return 0
        fi
        echo "redis-ha: the Sentinels hold the primary $found for down or are failing it over; waiting" >&2
        sleep 2
        waited=$((waited + 2))
    done
    if found=$(from_redis_pods "${OWN_REDIS-}"); then
        echo "redis-ha: no Sentinel answers; $found answers ROLE as the primary" >&2
    else
        found=$(entries "$REDIS_NODES" | sed -n 1p)
        echo "redis-ha: neither a Sentinel nor a Redis pod knows a primary: $found, the first pod, is it" >&2
    fi
    echo "$found"
}

redis_conf() {
    base=$1 out=$2
    need POD_NAME REDIS_NODES SENTINELS SENTINEL_MASTER SENTINEL_CLIENT_PASSWORD REDIS_SENTINEL_PASSWORD \
        REDIS_REPLICATION_PASSWORD REDIS_MIN_REPLICAS_TO_WRITE REDIS_MIN_REPLICAS_MAX_LAG
    safe_password REDIS_REPLICATION_PASSWORD
    [ -r "$base" ] || fail "cannot read $base"
    OWN_REDIS=$(own_entry "$REDIS_NODES")
    primary=$(current_primary)
    umask 077
    {
        cat "$base"
        echo
        echo "# Redis with Sentinel (deploy/k8s/components/sentinel/redis-ha.sh), for $POD_NAME"
        # Sentinel learns the replicas from the primary's INFO: by this stable name, not the pod's IP.
        echo "replica-announce-ip $(host_of "$OWN_REDIS")"
        echo "replica-announce-port $(port_of "$OWN_REDIS")"
        echo "masteruser replication"
        echo "masterauth $REDIS_REPLICATION_PASSWORD"
        # A primary refuses writes while fewer replicas than this acknowledged within the lag (seconds):
        # a primary cut off from its replicas stops taking writes that a failover would lose.
        echo "min-replicas-to-write $REDIS_MIN_REPLICAS_TO_WRITE"
        echo "min-replicas-max-lag $REDIS_MIN_REPLICAS_MAX_LAG"
        if [ "$primary" = "$OWN_REDIS" ]; then
            echo "# the primary"
        else
            echo "replicaof $(host_of "$primary") $(port_of "$primary")"
        fi
    } >"$out.tmp"
    mv "$out.tmp" "$out"
}

sentinel_conf() {
    out=$1
    need POD_NAME REDIS_NODES SENTINELS SENTINEL_MASTER SENTINEL_CLIENT_PASSWORD SENTINEL_ADMIN_PASSWORD \
        REDIS_SENTINEL_PASSWORD SENTINEL_QUORUM SENTINEL_DOWN_AFTER_MS SENTINEL_FAILOVER_TIMEOUT_MS
    for name in SENTINEL_ADMIN_PASSWORD SENTINEL_CLIENT_PASSWORD REDIS_SENTINEL_PASSWORD; do
        safe_password "$name"
    done
    OWN_SENTINEL=$(own_entry "$SENTINELS")
    primary=$(current_primary)
    # Sentinel refuses to start on a master name it cannot resolve: wait for the pod's DNS record.
    waited=0
    until getent hosts "$(host_of "$primary")" >/dev/null 2>&1; do
        [ "$waited" -lt "${SENTINEL_RESOLVE_WAIT_S:-300}" ] || fail "$(host_of "$primary") does not resolve"
        sleep 2
        waited=$((waited + 2))
    done
    master=$SENTINEL_MASTER
    umask 077
    cat >"$out.tmp" <<EOF
# Written by deploy/k8s/components/sentinel/redis-ha.sh for $POD_NAME; Sentinel rewrites it as it learns.
port $(port_of "$OWN_SENTINEL")
dir $(dirname "$out")
# Pods change IP when they are recreated: everyone is known by the headless Services' names.
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $(host_of "$OWN_SENTINEL")
sentinel announce-port $(port_of "$OWN_SENTINEL")
# Who may talk to this Sentinel: \`admin\` (the other Sentinels, operators) and \`client\` (the tailcut
# processes and KEDA: where the primary is, and its change), passwords stored hashed.
user default off resetpass resetkeys resetchannels -@all
user admin on #$(sha256 "$SENTINEL_ADMIN_PASSWORD") ~* &* +@all
user client on #$(sha256 "$SENTINEL_CLIENT_PASSWORD") resetkeys resetchannels &+switch-master &+replica-reconf-done -@all +ping +role +sentinel|get-master-addr-by-name +sentinel|masters +sentinel|master +sentinel|sentinels +sentinel|replicas +sentinel|slaves +sentinel|myid +subscribe +unsubscribe
sentinel sentinel-user admin
sentinel sentinel-pass $SENTINEL_ADMIN_PASSWORD
sentinel monitor $master $(host_of "$primary") $(port_of "$primary") $SENTINEL_QUORUM
sentinel auth-user $master sentinel
sentinel auth-pass $master $REDIS_SENTINEL_PASSWORD
sentinel down-after-milliseconds $master $SENTINEL_DOWN_AFTER_MS
sentinel failover-timeout $master $SENTINEL_FAILOVER_TIMEOUT_MS
sentinel parallel-syncs $master 1
EOF
    mv "$out.tmp" "$out"
}

case ${1-} in
    redis-conf)
        [ $# -eq 3 ] || fail "usage: redis-ha.sh redis-conf BASE OUT"
        redis_conf "$2" "$3"
        ;;
    sentinel-conf)
        [ $# -eq 2 ] || fail "usage: redis-ha.sh sentinel-conf OUT"
        sentinel_conf "$2"
        ;;
    primary)
        need REDIS_NODES SENTINELS SENTINEL_MASTER SENTINEL_CLIENT_PASSWORD REDIS_SENTINEL_PASSWORD
        primary=$(current_primary)
        echo "$(host_of "$primary") $(port_of "$primary")"
        ;;
    *) fail "usage: redis-ha.sh redis-conf BASE OUT | sentinel-conf OUT | primary" ;;
esac
