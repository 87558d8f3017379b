# s45 c1 ran c2.sh as it stands, with an install that lacked the test and bench binaries (pack.sh
# without EXTRA): only kb_head, kb_off, kt_head and the decode bench ran. Its logs: c1/logs.tgz.
exec bash "$(dirname "$0")/c2.sh"
