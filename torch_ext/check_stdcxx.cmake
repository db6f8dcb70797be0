# cmake -DMODULE=<built module> -DNM=<nm> -P check_stdcxx.cmake
# Fails (and removes the module) when the module defines libstdc++'s own out-of-line members:
# a toolchain that links (part of) libstdc++ statically gives the module a second copy beside
# the one torch's process runs on, and the two disagree on locale facet ids -- the first number
# an std::ostringstream formats crashes (seen on the GPU machine, docs/gpu.md, "The first GPU
# run"). A failed build says why; a crash at init_process_group would not.
execute_process(COMMAND "${NM}" -D --defined-only "${MODULE}"
                OUTPUT_VARIABLE _syms RESULT_VARIABLE _rc ERROR_QUIET)
if(NOT _rc EQUAL 0)
  message(WARNING "check_stdcxx: ${NM} could not read ${MODULE}; not checked")
  return()
endif()
string(REGEX MATCHALL "[^\n]* (_ZNSo9_M_insertI|_ZNKSt7codecvtI|_ZNSt6locale)[^\n]*" _own "${_syms}")
if(_own)
  list(LENGTH _own _n)
  file(REMOVE "${MODULE}")
  message(FATAL_ERROR "${MODULE} defines ${_n} of libstdc++'s own symbols (std::locale, "
          "std::codecvt, std::ostream::_M_insert): this toolchain linked libstdc++ into it "
          "statically, and beside torch's libstdc++ it would crash. Link against the shared "
          "libstdc++ (no -static-libstdc++; a g++ whose libstdc++.so is installed).")
endif()
