# Leaves llama.cpp's common library (and cpp-httplib, used only by it) out of the
# llama-cpp-python build: `make install` passes this file as CMAKE_PROJECT_llama.cpp_INCLUDE,
# so CMake runs it right after llama.cpp's project() call, in llama.cpp's directory scope.
# llama-cpp-python's CMakeLists.txt forces the cache variable LLAMA_BUILD_COMMON ON; a normal
# variable shadows the cache one in this scope and below, and llama.cpp's option() keeps it
# (CMP0077, llama.cpp requires CMake >= 3.14). The Python package never loads libllama-common
# (llama_cpp/lib holds libllama and libggml*; common went to the wheel's top-level lib/), and
# it was 42% of the compile time (735 of 1,740 CPU seconds of compiler steps in a llama.cpp
# build's .ninja_log on this kind of machine): a wheel build took 186 CPU seconds without it.
set(LLAMA_BUILD_COMMON OFF)
