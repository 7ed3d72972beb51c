#!/bin/sh
# Start Redis for the tailcut stack: write the ACL file from its template (each {{VAR}} becomes the
# SHA-256 of the environment variable VAR, so Redis never sees a password in clear), then exec
# redis-server with redis.conf, that ACL file and any extra arguments ("$@": `--maxmemory 4gb`, or a
# test's `--port N --bind 127.0.0.1 --dir DIR`).
#
# In the redis image it hands over to the image's own docker-entrypoint.sh (which drops root for the
# `redis` user); elsewhere it runs redis-server directly. Every path can be moved by the environment,
# so the same script starts a Redis outside Docker (tests/integration/test_redis_acl.py):
#   REDIS_ACL_TEMPLATE  default: users.acl.template beside this script
#   REDIS_CONFIG        default: redis.conf beside this script
#   REDIS_ACL_FILE      default: /tmp/tailcut-redis/users.acl (written at every start)
#   REDIS_SERVER        default: redis-server
set -eu

here=$(cd "$(dirname "$0")" && pwd)
template=${REDIS_ACL_TEMPLATE:-$here/users.acl.template}
config=${REDIS_CONFIG:-$here/redis.conf}
acl_file=${REDIS_ACL_FILE:-/tmp/tailcut-redis/users.acl}
server=${REDIS_SERVER:-redis-server}

fail() {
    echo "redis entrypoint: $*" >&2
    exit 1
}

[ -r "$template" ] || fail "cannot read the ACL template $template (REDIS_ACL_TEMPLATE)"
[ -r "$config" ] || fail "cannot read the Redis configuration $config (REDIS_CONFIG)"
command -v sha256sum >/dev/null 2>&1 || fail "sha256sum is needed to hash the passwords"

mkdir -p "$(dirname "$acl_file")"
umask 077
# Drop comments, join indented continuation lines to their `user` line.
awk '
    /^[[:space:]]*#([[:space:]]|$)/ { next }
    /^[[:space:]]*$/ { next }
    /^[[:space:]]/ { sub(/^[[:space:]]+/, ""); line = line " " $0; next }
    { if (line != "") print line; line = $0 }
    END { if (line != "") print line }
' "$template" >"$acl_file.tmp"

# Fill in the hashes: one sed expression per variable the users name.
expressions="-e b"
for name in $(grep -o '{{[A-Za-z_][A-Za-z0-9_]*}}' "$acl_file.tmp" | tr -d '{}' | sort -u); do
    eval "value=\${$name-}"
    [ -n "$value" ] || fail "$name is not set: put it in .env (openssl rand -hex 32)"
    # The same value goes into the services' redis:// URLs, where other characters need escaping.
    case $value in
        *[!A-Za-z0-9._~-]*) fail "$name may only hold letters, digits and . _ ~ - (openssl rand -hex 32 makes one)" ;;
    esac
    hash=$(printf '%s' "$value" | sha256sum | cut -d ' ' -f 1)
    expressions="-e s/{{$name}}/$hash/g $expressions"
done
# shellcheck disable=SC2086  # $expressions is a list of sed arguments
sed $expressions "$acl_file.tmp" >"$acl_file"
rm -f "$acl_file.tmp"

# `docker compose run redis redis-server ...`: the command is redis-server's arguments.
[ "${1:-}" = redis-server ] && shift
if command -v docker-entrypoint.sh >/dev/null 2>&1; then
    # The image's entrypoint runs redis-server as the `redis` user: let it read the file.
    [ "$(id -u)" = 0 ] && chown redis "$(dirname "$acl_file")" "$acl_file"
    exec docker-entrypoint.sh redis-server "$config" --aclfile "$acl_file" "$@"
fi
exec "$server" "$config" --aclfile "$acl_file" "$@"
