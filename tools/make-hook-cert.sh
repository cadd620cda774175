#!/usr/bin/env bash
# The hook server's TLS Secret (NAMESPACE/noctaya-hooks-tls: tls.crt, tls.key, ca.crt) from a private CA
# kept in NAMESPACE/noctaya-hooks-ca (kubernetes.io/tls: tls.crt, tls.key; cert-manager's layout for a
# CA). The controllers verify the hook server against noctaya-hooks-tls's ca.crt (their webhook
# caBundle), which Metacontroller reads only when it starts a controller; the hook server reloads its
# certificate when the Secret changes. So:
#
#   tools/make-hook-cert.sh [NAMESPACE] [DAYS]       first run: a CA (10 years) and a certificate for DAYS
#                                                    (defaults: noctaya-system 365); later runs: a new
#                                                    certificate from the same CA, ca.crt unchanged,
#                                                    nothing else to do
#   tools/make-hook-cert.sh --new-ca [NAMESPACE]     step 1 of a CA change: a new CA, added to ca.crt
#                                                    beside the old one; the served certificate stays.
#                                                    Then restart Metacontroller (it rereads ca.crt) and
#                                                    run again without --new-ca: step 2 issues the
#                                                    certificate from the new CA
#   tools/make-hook-cert.sh --drop-old-cas [NAMESPACE] [DAYS]
#                                                    after step 2: a new certificate, and ca.crt holds
#                                                    the current CA only
#
# Whoever can read Secrets in NAMESPACE can read the CA key, as they can the serving key beside it.
# For automatic renewal prefer cert-manager: examples/security/hook-server-cert-manager.yaml. The steps
# and why: docs/install.md, "Certificates: rotation and expiry".
set -euo pipefail

new_ca=false; drop_old=false; positional=()
for arg in "$@"; do
  case "$arg" in
    --new-ca) new_ca=true ;;
    --drop-old-cas) drop_old=true ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "make-hook-cert.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) positional+=("$arg") ;;
  esac
done
ns="${positional[0]:-noctaya-system}"; days="${positional[1]:-365}"
if [[ ${#positional[@]} -gt 2 || ! "$days" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: make-hook-cert.sh [--new-ca | --drop-old-cas] [NAMESPACE] [DAYS]" >&2; exit 2
fi
if $new_ca && $drop_old; then
  echo "make-hook-cert.sh: --new-ca and --drop-old-cas are two steps of a CA change, not one" >&2; exit 2
fi
host="noctaya-hooks.${ns}.svc"
ca_days=3650
manager=noctaya-make-hook-cert
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cd "$work"

# Writes the Secret's key into FILE; false (and no file) when the Secret or the key is absent.
secret_key() {
  local secret="$1" key="$2" file="$3" data
  data="$(kubectl -n "$ns" get secret "$secret" --ignore-not-found -o "jsonpath={.data.${key//./\\.}}")"
  [[ -n "$data" ]] || return 1
  printf '%s' "$data" | base64 -d > "$file"
}

# SHA-256 fingerprint of every certificate in a PEM file, one a line.
fingerprints() {
  awk '/-----BEGIN CERTIFICATE-----/ { n++; out = "split-" n ".pem" } out { print > out }
       /-----END CERTIFICATE-----/ { close(out); out = "" }' "$1"
  for part in split-*.pem; do
    [[ -e "$part" ]] && openssl x509 -noout -fingerprint -sha256 -in "$part" && rm -f "$part"
  done
  return 0
}

# Server-side apply of the Secret made by `kubectl create secret ARGS...`: no last-applied annotation,
# which would hold a second copy of the keys (and `kubectl describe` prints annotations). kubectl moves
# the fields of an earlier client-side apply (this script's earlier versions) to the server-side manager,
# so that annotation, absent from what is applied here, is removed too.
apply_secret() {
  local name="$1"; shift
  kubectl -n "$ns" create secret "$@" "$name" --dry-run=client -o yaml |
    kubectl apply --server-side --force-conflicts --field-manager="$manager" -f - >/dev/null
}

make_ca() {
  # Dated, so that the old and the new CA of a change differ by name as well as by key.
  openssl req -x509 -newkey rsa:3072 -nodes -days "$ca_days" -subj "/CN=noctaya-hooks-ca $(date -u +%Y%m%dT%H%M%SZ)" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout ca.key -out ca.crt 2>/dev/null
  apply_secret noctaya-hooks-ca tls --cert=ca.crt --key=ca.key
  echo "noctaya-hooks-ca in ${ns}: a new CA, valid ${ca_days} days"
}

issue_certificate() {
  openssl req -newkey rsa:3072 -nodes -subj "/CN=${host}" -keyout tls.key -out tls.csr 2>/dev/null
  printf 'subjectAltName=DNS:%s,DNS:%s.cluster.local\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' \
    "$host" "$host" > tls.ext
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -extfile tls.ext \
    -out tls.crt 2>/dev/null
  if ! openssl x509 -checkend "$((days * 86400))" -noout -in ca.crt >/dev/null; then
    echo "warning: the CA expires before this certificate does; change it (--new-ca) before then" >&2
  fi
}

if $new_ca || ! { secret_key noctaya-hooks-ca tls.crt ca.crt && secret_key noctaya-hooks-ca tls.key ca.key; }; then
  make_ca
fi
ca_fingerprint="$(fingerprints ca.crt)"

if ! secret_key noctaya-hooks-tls ca.crt bundle.crt || ! secret_key noctaya-hooks-tls tls.crt served.crt ||
   ! secret_key noctaya-hooks-tls tls.key served.key; then
  # First run: nothing trusts anything yet.
  issue_certificate
  cp ca.crt bundle.crt
elif fingerprints bundle.crt | grep -qxF "$ca_fingerprint"; then
  # The CA is in ca.crt, which Metacontroller read when it started (or restarted) the controllers.
  issue_certificate
  if $drop_old; then cp ca.crt bundle.crt; fi
else
  # A CA that Metacontroller does not trust yet: publish it beside the old one, keep serving the
  # certificate the old one signed, and let the next run (after Metacontroller rereads ca.crt) switch.
  cat bundle.crt ca.crt > bundle.new && mv bundle.new bundle.crt
  cp served.crt tls.crt; cp served.key tls.key
  apply_secret noctaya-hooks-tls generic --type=kubernetes.io/tls \
    --from-file=tls.crt --from-file=tls.key --from-file=ca.crt=bundle.crt
  echo "noctaya-hooks-tls in ${ns}: ca.crt now also trusts the new CA; the served certificate is unchanged."
  echo "Next: restart Metacontroller so that it reads the new ca.crt (docs/install.md, \"Certificates: rotation"
  echo "and expiry\"), then run this script again without --new-ca to serve a certificate from the new CA."
  exit 0
fi

apply_secret noctaya-hooks-tls generic --type=kubernetes.io/tls \
  --from-file=tls.crt --from-file=tls.key --from-file=ca.crt=bundle.crt
trusted="$(fingerprints bundle.crt | wc -l)"
echo "noctaya-hooks-tls in ${ns}: certificate for ${host}, valid ${days} days ($(openssl x509 -noout -enddate -in tls.crt)), ca.crt trusts ${trusted} CA(s)"
