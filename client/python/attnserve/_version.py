# The package's version: the project's one version, the `project(attnserve
# VERSION ...)` line of CMakeLists.txt (python_install_test checks they agree).
__version__ = "0.2.0"
