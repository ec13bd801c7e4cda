#!/bin/sh
# Entrypoint of the lab image: JupyterLab on 0.0.0.0:$JUPYTER_PORT, only with a token; and sshd on $SSH_PORT,
# keys only, when an authorized_keys file is mounted at $SSH_AUTHORIZED_KEYS.
#   docker run -e JUPYTER_TOKEN=<secret> -p 8888:8888 IMAGE          -> jupyter lab
#   ... -v ~/.ssh/id_ed25519.pub:/etc/stackproof/ssh/authorized_keys:ro -p 2222:2222 IMAGE
#                                                                     -> jupyter lab + ssh -p 2222 stackproof@host
#   docker run IMAGE jupyter nbconvert ... | bash | python3 ...        -> run as is
set -eu

if [ "$#" -gt 0 ]; then
    exec "$@"
fi
# No token, no server: an open Jupyter runs arbitrary code for anyone who can reach the port.
if [ -z "${JUPYTER_TOKEN:-}" ]; then
    echo "error: JUPYTER_TOKEN is empty; the lab refuses to start without a token." >&2
    echo "fix: docker run -e JUPYTER_TOKEN=\"\$(openssl rand -hex 24)\" ... (make lab makes one for you)" >&2
    exit 2
fi

# sshd as this (non-root) user: it can only log this user in, with a key from the mounted file. Its config, a
# copy of the keys (sshd's StrictModes refuses a file another uid owns) and a host key made for this container
# (none ships in the image) live in a folder only this user can read.
start_sshd() {
    # Under the home folder: StrictModes refuses keys below a world-writable folder such as /tmp.
    dir="$HOME/.stackproof-sshd"
    rm -rf "$dir"
    mkdir -m 700 "$dir"
    cp "$SSH_AUTHORIZED_KEYS" "$dir/authorized_keys"
    chmod 600 "$dir/authorized_keys"
    ssh-keygen -q -t ed25519 -N "" -C "stackproof-lab host key" -f "$dir/host_ed25519_key"
    # A session's environment is sshd's, not the image's: hand it the image's Python, paths and settings.
    setenv="$(env | grep -E '^(PATH|VIRTUAL_ENV|PYTHONPATH|PYTHONUNBUFFERED|LD_LIBRARY_PATH|PIP_[A-Z_]+|(STACKPROOF|NVIDIA|CUDA|NCCL|TORCH)[A-Z_]*)=' \
        | grep -v ' ' | tr '\n' ' ')"
    cat >"$dir/sshd_config" <<CONFIG
Port ${SSH_PORT}
HostKey $dir/host_ed25519_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
AuthenticationMethods publickey
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
PermitEmptyPasswords no
AllowUsers $(id -un)
UsePAM no
X11Forwarding no
PrintMotd no
SetEnv ${setenv}
CONFIG
    if ! /usr/sbin/sshd -t -f "$dir/sshd_config"; then
        echo "error: sshd refused its configuration ($dir/sshd_config, above); the lab does not start." >&2
        exit 2
    fi
    /usr/sbin/sshd -D -e -f "$dir/sshd_config" &
    echo "ssh: keys from $SSH_AUTHORIZED_KEYS, port $SSH_PORT, user $(id -un); host key $(ssh-keygen -l -f "$dir/host_ed25519_key.pub")" >&2
}

if [ -f "$SSH_AUTHORIZED_KEYS" ]; then
    start_sshd
else
    echo "ssh: off (mount an authorized_keys file at $SSH_AUTHORIZED_KEYS to turn it on)" >&2
fi
# jupyter_server reads the token from JUPYTER_TOKEN itself, so it never shows up in the process list.
exec jupyter lab --ip=0.0.0.0 --port="${JUPYTER_PORT:-8888}" --no-browser \
    --ServerApp.root_dir=/home/stackproof/work --ServerApp.allow_remote_access=True
