# The version header: CMake's project(VERSION) and the git commit, written to
# <build>/include/attnserve/version.h at configure time. CMake re-runs when
# HEAD moves (a commit, checkout or reset), so the commit stays current; the
# file is rewritten only when its text changes, and only common/version.cc
# includes it, so a new commit recompiles one file.

set(ATTNSERVE_GIT_COMMIT "" CACHE STRING
  "commit that --version reports when the source tree has no .git (a container build); empty: ask git")

# attnserve_git_commit(<var>): short hash of HEAD, or "unknown".
function(attnserve_git_commit out)
  if(ATTNSERVE_GIT_COMMIT)
    set(${out} "${ATTNSERVE_GIT_COMMIT}" PARENT_SCOPE)
    return()
  endif()
  set(${out} unknown PARENT_SCOPE)
  find_package(Git QUIET)
  if(NOT GIT_FOUND)
    return()
  endif()
  execute_process(COMMAND ${GIT_EXECUTABLE} rev-parse --short HEAD
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR} RESULT_VARIABLE rc
    OUTPUT_VARIABLE hash OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT rc EQUAL 0 OR hash STREQUAL "")
    return()
  endif()
  set(${out} "${hash}" PARENT_SCOPE)
  # Files that change when HEAD moves: HEAD itself, its reflog (every commit,
  # checkout and reset appends to it) and the branch it names. --git-path
  # finds them in a linked worktree too. Only files that exist: a missing
  # one would re-run CMake on every build.
  execute_process(COMMAND ${GIT_EXECUTABLE} symbolic-ref -q HEAD
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR}
    OUTPUT_VARIABLE branch OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  foreach(name HEAD logs/HEAD ${branch})
    execute_process(COMMAND ${GIT_EXECUTABLE} rev-parse --git-path ${name}
      WORKING_DIRECTORY ${CMAKE_SOURCE_DIR}
      OUTPUT_VARIABLE path OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    get_filename_component(path "${path}" ABSOLUTE BASE_DIR ${CMAKE_SOURCE_DIR})
    if(path AND EXISTS "${path}")
      set_property(DIRECTORY ${CMAKE_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${path}")
    endif()
  endforeach()
endfunction()

attnserve_git_commit(ATTNSERVE_COMMIT)
configure_file(${CMAKE_SOURCE_DIR}/cmake/version.h.in
  ${CMAKE_BINARY_DIR}/include/attnserve/version.h @ONLY)
