# Shell helpers for the scripts that install Debian packages or read the
# machine's apt sources. Source it; it defines functions only.

is_root_with_apt() { [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; }

# The Debian codename of this machine (bookworm, ...), or nothing.
debian_codename() {
    # shellcheck disable=SC1091
    ( . /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}" )
}

# Prints the Debian mirror URL the configured apt sources use for the release.
debian_mirror() {
    local codename=$1 url=""
    url=$(awk -v suite="$codename" '
        function flush() {
            if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uris != "") {
                split(uris, u, " "); print u[1]; found = 1; exit
            }
            types = ""; suites = ""; uris = ""
        }
        FNR == 1   { flush() }
        /^[ \t]*$/ { flush(); next }
        /^Types:/  { sub(/^Types:[ \t]*/, "");  types = $0 }
        /^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites = $0 }
        /^URIs:/   { sub(/^URIs:[ \t]*/, "");   uris = $0 }
        END { if (!found) flush() }
    ' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    if [ -z "$url" ]; then
        url=$(sed -nE "s/^deb[ \t]+(\[[^]]*\][ \t]+)?([^ \t]+)[ \t]+${codename}[ \t].*/\2/p" \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1 || true)
    fi
    echo "${url:-http://deb.debian.org/debian}"
}

# Installs the Debian packages named, as root with apt; otherwise fails and
# says what to install. $1 names the caller in messages.
apt_install() {
    local who=$1; shift
    [ $# -gt 0 ] || return 0
    if ! is_root_with_apt; then
        echo "$who: please install: $*" >&2
        return 1
    fi
    echo "$who: installing $*" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
