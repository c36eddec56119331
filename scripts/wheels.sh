# wheels.sh, sourced by the scripts that install pinned NVIDIA wheels as a
# prefix under .tools: install_wheels DEST PKG... empties DEST and installs
# the packages, without their dependencies, into DEST/.site (PYTHON, default
# python3, runs pip).
install_wheels() {
  local dest="$1"
  shift
  rm -rf "$dest"
  mkdir -p "$dest/.site"
  "${PYTHON:-python3}" -m pip install --quiet --no-deps --no-compile --disable-pip-version-check \
    --target "$dest/.site" "$@"
}
