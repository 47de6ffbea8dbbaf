# Strata as a library other projects embed:
#   - in a source tree (add_subdirectory / FetchContent): the target Strata::strata;
#   - installed (cmake --install BUILD --prefix P): find_package(Strata) gives the same target.
# The user includes one header, <strata/strata.h>. The engine is a template over the user's
# module, so the internal headers that header reaches (and only those) are installed under
# include/strata/ as an implementation detail; Strata::strata puts both include/ and
# include/strata/ on the include path.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# strata/version.h: the version and what this build was made with (every tool's --version).
foreach(_f CUDA NCCL)
  if(STRATA_HAS_${_f})
    set(STRATA_HAS_${_f}_01 1)
    set(STRATA_HAS_${_f}_YESNO yes)
  else()
    set(STRATA_HAS_${_f}_01 0)
    set(STRATA_HAS_${_f}_YESNO no)
  endif()
endforeach()
configure_file(${PROJECT_SOURCE_DIR}/cmake/version.h.in
               ${PROJECT_BINARY_DIR}/include/strata/version.h @ONLY)

# The tools print it (--version); the examples and the tools below get it through Strata::strata.
target_include_directories(strata-config PRIVATE ${PROJECT_BINARY_DIR}/include)
target_include_directories(strata-ckpt PRIVATE ${PROJECT_BINARY_DIR}/include)
# strata-run includes nothing of Strata's upper layers: the same line as a definition.
target_compile_definitions(strata-run PRIVATE
  "STRATA_VERSION_LINE=\"strata ${PROJECT_VERSION} (Torch ${Torch_VERSION}, CUDA ${STRATA_HAS_CUDA_YESNO}, NCCL ${STRATA_HAS_NCCL_YESNO})\"")

# The in-tree target. The examples and the tools link it as a user does.
add_library(strata INTERFACE)
add_library(Strata::strata ALIAS strata)
# A sanitized build's libraries need the sanitizer's runtime in whatever links them.
if(STRATA_SANITIZE)
  target_link_options(strata INTERFACE -fsanitize=${STRATA_SANITIZE})
endif()
target_include_directories(strata INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>)
target_link_libraries(strata INTERFACE strata_models strata_runtime)

# --- install -------------------------------------------------------------------------------------
set(STRATA_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Strata)
# The static libraries Strata::strata links, users before what they use (one pass of the linker).
set(STRATA_PACKAGE_LIBS strata_models strata_runtime strata_nn strata_monitor strata_precision strata_zero strata_moe strata_recompute strata_config
                        strata_offload strata_comm strata_util)
install(TARGETS ${STRATA_PACKAGE_LIBS} ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS strata-run strata-config strata-ckpt train_gpt
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Headers: <strata/strata.h>, <strata/models.h>, strata/version.h, and every Strata header they reach through
# quoted includes (found here by following them, so the list never goes stale).
set(_strata_todo)
foreach(_top strata.h models.h)
  file(STRINGS ${PROJECT_SOURCE_DIR}/include/strata/${_top} _lines REGEX "^#include \"")
  foreach(_l IN LISTS _lines)
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" _h "${_l}")
    if(EXISTS ${PROJECT_SOURCE_DIR}/${_h})
      list(APPEND _strata_todo ${_h})
    endif()
  endforeach()
endforeach()
set(STRATA_PUBLIC_HEADERS)
while(_strata_todo)
  list(POP_FRONT _strata_todo _h)
  if(_h IN_LIST STRATA_PUBLIC_HEADERS)
    continue()
  endif()
  list(APPEND STRATA_PUBLIC_HEADERS ${_h})
  set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
               ${PROJECT_SOURCE_DIR}/${_h})
  file(STRINGS ${PROJECT_SOURCE_DIR}/${_h} _lines REGEX "^#include \"")
  foreach(_l IN LISTS _lines)
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" _inc "${_l}")
    if(EXISTS ${PROJECT_SOURCE_DIR}/${_inc})
      list(APPEND _strata_todo ${_inc})
    else()
      message(FATAL_ERROR "${_h} includes \"${_inc}\", which is not a path from the source root")
    endif()
  endforeach()
endwhile()
list(SORT STRATA_PUBLIC_HEADERS)
foreach(_h IN LISTS STRATA_PUBLIC_HEADERS)
  get_filename_component(_dir ${_h} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${_h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/${_dir})
endforeach()
set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             ${PROJECT_SOURCE_DIR}/include/strata/strata.h ${PROJECT_SOURCE_DIR}/include/strata/models.h)
install(FILES ${PROJECT_SOURCE_DIR}/include/strata/strata.h ${PROJECT_SOURCE_DIR}/include/strata/models.h
              ${PROJECT_BINARY_DIR}/include/strata/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata)

# The CMake package: StrataConfig.cmake finds the dependencies this build used (hinted by the
# folders it found them in) and defines Strata::strata over the installed static libraries.
set(STRATA_CONFIG_LIBS)
foreach(_lib IN LISTS STRATA_PACKAGE_LIBS)
  list(APPEND STRATA_CONFIG_LIBS "${CMAKE_STATIC_LIBRARY_PREFIX}${_lib}${CMAKE_STATIC_LIBRARY_SUFFIX}")
endforeach()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/StrataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/StrataConfig.cmake
  INSTALL_DESTINATION ${STRATA_INSTALL_CMAKEDIR}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR CMAKE_INSTALL_LIBDIR)
# 0.x: a minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/StrataConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/StrataConfig.cmake ${PROJECT_BINARY_DIR}/StrataConfigVersion.cmake
        DESTINATION ${STRATA_INSTALL_CMAKEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/config.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR} OPTIONAL)
